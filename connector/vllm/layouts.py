"""vLLM's paged KV layouts behind kvtier's one interface (`engine.kv_cache.PagedKVLayout`).

vLLM 0.32 gives a connector, per attention layer, a tensor of logical shape
`(num_blocks, num_kv_heads, block_size, 2 * head_size)`; what the last two axes mean depends
on the attention backend (docs/vllm.md):
- CPU: each (block, head) page (a "tile": `block_size * 2 * head_size` elements, contiguous)
  is laid out by the kernels vLLM's CPU attention picks (its "ISA"), and only inside the tile.
  - `VllmCpuLayout` ("vec"/"vec16"): K transposed, `(head_size, block_size)`, then V,
    `(block_size, head_size)`.
  - `VllmAmxLayout` ("amx", 2-byte K/V): K in groups of 16 tokens, each token's elements in
    pairs (4 bytes) interleaved across the group's tokens; V in 16-element head groups, each
    token pair's values interleaved (vLLM's csrc/cpu/cpu_attn_amx.hpp, `reshape_and_cache`).
  - `VllmTileLayout` (any other ISA, fp8 under "amx", or any ISA when `cpu_page_form` is
    "tiles"): the tile's bytes as they are, never decoded.
  tests/vllm/test_cpu_layout_kernel.py checks each against vLLM's `cpu_attn_reshape_and_cache`.
- GPU FlashAttention (`VllmFlashLayout`): each token row is `[K | V]`, K the first
  `head_size` values; the tensor may be any strided view (vLLM's `LBNHC` allocation is
  token-major `(num_blocks, block_size, H, 2D)` permuted).
kvtier's engine layout `(2, num_blocks, block_size, H, D)` is `engine.kv_cache.EngineLayout`.
Slot ids are the same everywhere: `block * block_size + offset`.

Decoded layouts give chunks in the canonical form `(layers, 2, tokens, H, D)`, shared by every
layout that decodes to it. A tile chunk has the same shape and dtype, but token `b * block_size
+ o` of head `h` holds elements `[o * D, (o + 1) * D)` of each half of tile (b, h): only whole
blocks move, and only instances with the same tile format can read it, so the keyspace names
the format (connector/vllm/setup.py) and cuts spans to whole blocks (`token_multiple`). The KV
head stays an axis of its own, so tiles split by head and load at any tensor-parallel size.

Each layout says where K and V sit: per layer, views of the cache, one for K and one for V
(vLLM's own split). A gather or scatter is then one advanced-indexing op per layer and K/V over
(block, offset), with no per-token loop; writes go through the views into the caller's tensors.
(One op over all layers through a stacked `as_strided` view was no faster, so there is none.)
On CPU, `VllmCpuLayout` and `VllmTileLayout` move whole chunks in one compiled call instead
(engine/csrc/kv_pages.cpp): K^T pages make the indexing path slow, and tiles copied as token
rows are near a plain copy there. This module never imports vllm.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from types import ModuleType

import torch

from connector.connector_config import PAGE_FORMS
from engine import cpu_ops
from engine.kv_cache import EngineLayout, PagedKVLayout, check_slots, request_slots

NULL_BLOCK = 0
"""vLLM's placeholder block id (its block pool's first block): a KV cache group's table holds
it where the group keeps no K/V (a sliding window's positions before the window)."""


class _SplitKVLayout(PagedKVLayout):
    """Per layer `(num_blocks, H, block_size, 2*D)`; a subclass says, by `_halves`, where K
    and V sit."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], layer_groups: Sequence[int] | None = None) -> None:
        if len(kv_caches) == 0:
            raise ValueError("kv_caches is empty")
        ref = kv_caches[0]
        if ref.dim() != 4 or ref.shape[3] % 2:
            raise ValueError(f"{type(self).__name__}: each kv_cache must be (num_blocks, num_kv_heads, "
                             f"block_size, 2 * head_size), got {tuple(ref.shape)}")
        nb, h, bs, d2 = ref.shape
        super().__init__(kv_caches, bs, nb, h, d2 // 2)
        self._kv_views = [self._halves(kv) for kv in self.kv_caches]
        # With KV cache groups (vLLM's hybrid KV cache manager) slots are (groups, n), -1 at null
        # blocks, even for one group (a model whose every layer slides); without, 1-D.
        self.grouped = layer_groups is not None
        self.layer_groups = list(layer_groups) if layer_groups is not None else [0] * len(kv_caches)
        if len(self.layer_groups) != len(kv_caches):
            raise ValueError(f"layer_groups names {len(self.layer_groups)} layers, the caches are {len(kv_caches)}")
        self.num_groups = max(self.layer_groups) + 1

    def group_slots(self, block_ids: Sequence[Sequence[int]], start: int, end: int) -> torch.Tensor:
        """Returns `(num_groups, n)` slots with -1 where a group's block is vLLM's null block
        (NULL_BLOCK: a sliding window's skipped positions); 1-D slots without KV cache groups."""
        if not self.grouped:
            return super().group_slots(block_ids, start, end)
        if len(block_ids) != self.num_groups:
            raise ValueError(f"{self.num_groups} KV cache groups, got block tables for {len(block_ids)}")
        out = []
        for table in block_ids:
            slots = request_slots(table, self.block_size, start, end)
            null = torch.as_tensor(table, dtype=torch.long)[torch.arange(start, end) // self.block_size] == NULL_BLOCK
            out.append(slots.masked_fill_(null, -1))
        return torch.stack(out)

    @abstractmethod
    def _halves(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns views (never copies) K and V of one layer's cache as `_move_group` indexes
        them, `(num_blocks, block_size, H, D)` unless a subclass says otherwise; ValueError if
        the cache's strides do not allow them."""

    def _positions(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (blocks, offsets) of valid `slots` on the caches' device."""
        check_slots(slots, self.num_slots)  # host-side slots: no device sync
        slots = slots.to(self.device, non_blocking=True)
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        return blocks, slots - blocks * self.block_size

    def _move(self, layers: Sequence[int], slots: torch.Tensor, chunk: torch.Tensor | Sequence[torch.Tensor],
              to_cache: bool) -> None:
        """Copies the K/V of `slots` (checked) in `layers` into the caches from `chunk` (`to_cache`),
        else from the caches into `chunk`: `[len(layers), 2, n, H, D]`, or one `[2, n, H, D]`
        tensor per layer. `(num_groups, n)` slots: each layer at its group's; a group's -1
        positions are not written, and cannot be read (ValueError)."""
        if slots.dim() == 1 or not self.grouped:
            self._move_group(layers, slots, chunk, to_cache)  # which checks the slots are 1-D
            return
        if slots.dim() != 2 or slots.shape[0] != self.num_groups:
            raise ValueError(f"slots must be ({self.num_groups}, n), one row per KV cache group, "
                             f"got {tuple(slots.shape)}")
        for g, group in enumerate(slots):
            idx = [i for i, layer in enumerate(layers) if self.layer_groups[layer] == g]
            held = group >= 0
            if not idx or bool(held.all()):
                if idx:
                    self._move_group([layers[i] for i in idx], group, [chunk[i] for i in idx], to_cache)
                continue
            if not to_cache:
                raise ValueError(f"KV cache group {g} holds no block for some of these positions")
            pos = held.nonzero().squeeze(1)
            self._move_group([layers[i] for i in idx], group[pos], [chunk[i][:, pos] for i in idx], True)

    def _whole_blocks(self, slots: torch.Tensor) -> int:
        """Returns how many whole blocks `slots` (1-D, host) begin with: runs of `block_size`
        consecutive slots, each from a block's first."""
        bs = self.block_size
        m = slots.shape[0] // bs
        if m == 0 or slots.dim() != 1:
            return 0
        runs = slots[:m * bs].view(m, bs)
        whole = (runs[:, 0] % bs == 0) & (runs == runs[:, :1] + torch.arange(bs)).all(dim=1)
        return int(whole.long().cumprod(0).sum())

    def _block_ids(self, slots: torch.Tensor) -> torch.Tensor:
        """Returns the blocks of `slots` that are `_whole_blocks`, on the caches' device."""
        return (slots[::self.block_size] // self.block_size).to(self.device)

    def _move_group(self, layers: Sequence[int], slots: torch.Tensor,
                    chunk: torch.Tensor | Sequence[torch.Tensor], to_cache: bool) -> None:
        """`_move` for 1-D `slots`: every layer's K/V at the same slots."""
        blocks, offsets = self._positions(slots)
        for i, layer in enumerate(layers):
            k, v = self._kv_views[layer]
            if to_cache:
                k[blocks, offsets] = chunk[i][0]
                v[blocks, offsets] = chunk[i][1]
            else:
                chunk[i][0] = k[blocks, offsets]
                chunk[i][1] = v[blocks, offsets]

    def gather_chunk(self, slots: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.chunk_shape(self.num_layers, slots.shape[-1]), dtype=self.dtype, device=self.device)
        self._move(range(self.num_layers), slots, out, to_cache=False)
        return out

    def gather_layers(self, slots: torch.Tensor) -> list[torch.Tensor]:
        outs = [torch.empty(self.chunk_shape(1, slots.shape[-1]), dtype=self.dtype, device=self.device)
                for _ in range(self.num_layers)]
        self._move(range(self.num_layers), slots, [out[0] for out in outs], to_cache=False)
        return outs

    def scatter_chunk(self, slots: torch.Tensor, chunk: torch.Tensor) -> None:
        expected = self.chunk_shape(self.num_layers, slots.shape[-1])
        if tuple(chunk.shape) != expected:
            raise ValueError(f"chunk shape {tuple(chunk.shape)} does not match expected {expected}")
        chunk = chunk.to(device=self.device, dtype=self.dtype, non_blocking=True).contiguous()
        self._move(range(self.num_layers), slots, chunk, to_cache=True)

    def scatter_layer(self, layer: int, slots: torch.Tensor, layer_kv: torch.Tensor) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.num_layers})")
        expected = (2, slots.shape[-1], self.num_kv_heads, self.head_size)
        if tuple(layer_kv.shape) != expected:
            raise ValueError(f"layer shape {tuple(layer_kv.shape)} does not match {expected}")
        layer_kv = layer_kv.to(device=self.device, dtype=self.dtype, non_blocking=True).contiguous()
        self._move([layer], slots, layer_kv[None], to_cache=True)


class _CompiledPagesLayout(_SplitKVLayout):
    """A CPU layout of contiguous (block, head) pages whose copies run in engine/csrc's
    `copy_kv_pages` where it builds (several times faster than PyTorch's indexing through the
    views: `benchmarks/bench_load.py`'s vllm-cpu rows, `benchmarks/bench_cpu_pages.py`'s tile
    rows), else (or with `kernels=False`) through the views. `K_TRANSPOSED`: whether a page
    holds K transposed; else its K half is token rows like V's."""

    K_TRANSPOSED: bool

    def __init__(self, kv_caches: Sequence[torch.Tensor], layer_groups: Sequence[int] | None = None,
                 kernels: bool = True) -> None:
        super().__init__(kv_caches, layer_groups)
        self._ops = _page_kernels(self, kernels)

    def _move_group(self, layers: Sequence[int], slots: torch.Tensor,
                    chunk: torch.Tensor | Sequence[torch.Tensor], to_cache: bool,
                    heads: tuple[int, int] | None = None) -> None:
        """`_move` for 1-D `slots`; with `heads`, `chunk` holds only KV heads [heads) (compiled only)."""
        if self._ops is None:
            if heads is not None:
                raise ValueError("a move of some KV heads needs engine/csrc's compiled copies")
            self._move_by_views(layers, slots, chunk, to_cache)
            return
        check_slots(slots, self.num_slots)
        slots = slots.contiguous()
        if isinstance(chunk, torch.Tensor):
            lo, hi = heads if heads is not None else (0, self.num_kv_heads)
            self._ops.copy_kv_pages([self.kv_caches[layer][:, lo:hi] for layer in layers], chunk, slots, to_cache,
                                    self.K_TRANSPOSED)
            return
        if heads is not None:
            raise ValueError("a move of some KV heads takes the chunk as one tensor")
        for layer, per_layer in zip(layers, chunk, strict=True):
            self._ops.copy_kv_pages([self.kv_caches[layer]], per_layer[None], slots, to_cache, self.K_TRANSPOSED)

    def _move_by_views(self, layers: Sequence[int], slots: torch.Tensor,
                       chunk: torch.Tensor | Sequence[torch.Tensor], to_cache: bool) -> None:
        super()._move_group(layers, slots, chunk, to_cache)

    def scatter_heads(self, slots: torch.Tensor, pieces: Sequence[torch.Tensor]) -> None:
        """Copies each piece into its heads' pages, without joining them first (vLLM's chunks
        are stored a KV head per value). Through the views, or with slots per KV cache
        group, the joined chunk as the base class does."""
        if self._ops is None or slots.dim() != 1:
            super().scatter_heads(slots, pieces)
            return
        widths = self.head_widths(slots.shape[-1], pieces)
        h = 0
        for piece, w in zip(pieces, widths):
            piece = piece.to(device=self.device, dtype=self.dtype).contiguous()
            self._move_group(range(self.num_layers), slots, piece, True, heads=(h, h + w))
            h += w


class VllmCpuLayout(_CompiledPagesLayout):
    """vLLM's CPU attention backend ("vec"/"vec16" ISA): per (block, head) page, K^T
    `(D, block_size)` then V `(block_size, D)`. Each page must be contiguous, as the kernel
    addresses it by offset; blocks and heads may have any strides."""

    K_TRANSPOSED = True

    def _halves(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nb, h, bs, d2 = kv.shape
        d = d2 // 2
        # vLLM's split: kv.view(nb, h, 2 * bs, d).chunk(2, dim=2), K's half read as (d, bs).
        pages = _pages(kv, type(self).__name__)
        k = pages[..., :d * bs].unflatten(2, (d, bs)).permute(0, 3, 1, 2)
        v = pages[..., d * bs:].unflatten(2, (bs, d)).transpose(1, 2)
        return k, v


def _page_kernels(layout: _SplitKVLayout, kernels: bool) -> ModuleType | None:
    """Returns engine/csrc's compiled kernels for `layout`'s page copies when asked (`kernels`)
    and they apply (CPU caches of one stride) and build; else None (the copies go through the views)."""
    same_strides = all(kv.stride() == layout.kv_caches[0].stride() for kv in layout.kv_caches)
    return cpu_ops.load() if kernels and same_strides and layout.device.type == "cpu" else None


def _pages(kv: torch.Tensor, layout: str) -> torch.Tensor:
    """Returns one layer's CPU cache as `(num_blocks, H, block_size * 2 * D)` tiles, a view;
    ValueError unless each (block, head) tile is contiguous (vLLM's kernels address it by offset)."""
    nb, h, bs, d2 = kv.shape
    if kv.stride(3) != 1 or (bs > 1 and kv.stride(2) != d2):
        raise ValueError(f"{layout} needs each (block, head) page contiguous, got strides {kv.stride()}")
    return kv.view(nb, h, bs * d2)


class VllmAmxLayout(_SplitKVLayout):
    """vLLM's CPU attention backend with its "amx" kernels, K/V of 2 bytes (bfloat16): per
    (block, head) tile, K then V, `block_size * D` elements each (vLLM's split), with
    - K as `(block_size / 16, D / 2, 16, 2)`: element `[g, q, t, e]` is K[16 g + t, 2 q + e];
    - V as `(D / 16, block_size / 2, 16, 2)`: element `[i, s, j, e]` is V[2 s + e, 16 i + j].
    Decoded to the canonical form, so its chunks are shared with every decoded layout. Whole
    blocks move in engine/csrc's `copy_amx_blocks` where it builds (`kernels`), else, and any
    partial block, through the views."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], layer_groups: Sequence[int] | None = None,
                 kernels: bool = True) -> None:
        ref = kv_caches[0] if len(kv_caches) else None
        if ref is not None and (ref.element_size() != 2 or ref.dim() != 4 or ref.shape[2] % 32
                                or ref.shape[3] % 32):
            raise ValueError("VllmAmxLayout reads 2-byte K/V with block_size a multiple of 32 and head_size a "
                             f"multiple of 16, got {ref.dtype} caches of shape {tuple(ref.shape)}")
        super().__init__(kv_caches, layer_groups)
        self._ops = _page_kernels(self, kernels)

    def _halves(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns K `(num_blocks, H, bs / 16, D / 2, 16, 2)` and V `(num_blocks, H, D / 16,
        bs / 2, 16, 2)`, views of the tiles."""
        nb, h, bs, d2 = kv.shape
        d = d2 // 2
        pages = _pages(kv, type(self).__name__)
        k = pages[..., :bs * d].unflatten(2, (bs // 16, d // 2, 16, 2))
        v = pages[..., bs * d:].unflatten(2, (d // 16, bs // 2, 16, 2))
        return k, v

    def _move_group(self, layers: Sequence[int], slots: torch.Tensor,
                    chunk: torch.Tensor | Sequence[torch.Tensor], to_cache: bool) -> None:
        # Whole blocks are re-laid out block by block (several times faster than token by
        # token: benchmarks/bench_cpu_pages.py), the rest token by token.
        check_slots(slots, self.num_slots)
        m = self._whole_blocks(slots) * self.block_size
        if m:
            self._move_blocks(layers, slots[:m], [c[:, :m] for c in chunk], to_cache)
        if m < slots.shape[0]:
            self._move_tokens(layers, slots[m:], [c[:, m:] for c in chunk], to_cache)

    def _move_blocks(self, layers: Sequence[int], slots: torch.Tensor, chunk: Sequence[torch.Tensor],
                     to_cache: bool) -> None:
        """Moves whole blocks: `slots` are `_whole_blocks`."""
        d = self.head_size
        blocks = self._block_ids(slots)
        if self._ops is not None:
            self._ops.copy_amx_blocks([self.kv_caches[layer] for layer in layers], list(chunk), blocks.contiguous(),
                                      to_cache)
            return
        for i, layer in enumerate(layers):
            k, v = self._kv_views[layer]
            # chunk tokens as (block, group, token) and head elements as (pair, element): K's
            # tile axes are (head, group, pair, token, element), V's (head, group, pair, j, element).
            ck = chunk[i][0].unflatten(0, (-1, self.block_size // 16, 16)).unflatten(-1, (d // 2, 2))
            cv = chunk[i][1].unflatten(0, (-1, self.block_size // 2, 2)).unflatten(-1, (d // 16, 16))
            if to_cache:  # re-laid out in one pass, then copied a tile at a time
                k.index_copy_(0, blocks, ck.permute(0, 3, 1, 4, 2, 5).contiguous())
                v.index_copy_(0, blocks, cv.permute(0, 3, 4, 1, 5, 2).contiguous())
            else:
                ck.copy_(k[blocks].permute(0, 2, 4, 1, 3, 5))
                cv.copy_(v[blocks].permute(0, 3, 5, 1, 2, 4))

    def _move_tokens(self, layers: Sequence[int], slots: torch.Tensor, chunk: Sequence[torch.Tensor],
                     to_cache: bool) -> None:
        """Moves any slots, token by token."""
        blocks, offsets = self._positions(slots)
        n, h, d = slots.shape[0], self.num_kv_heads, self.head_size
        # Advanced indices split by slices: the token axis comes first, then the sliced axes.
        k_at = (blocks, slice(None), offsets // 16, slice(None), offsets % 16)
        v_at = (blocks, slice(None), slice(None), offsets // 2, slice(None), offsets % 2)
        for i, layer in enumerate(layers):
            k, v = self._kv_views[layer]
            if to_cache:
                k[k_at] = chunk[i][0].reshape(n, h, d // 2, 2)
                v[v_at] = chunk[i][1].reshape(n, h, d // 16, 16)
            else:
                chunk[i][0] = k[k_at].reshape(n, h, d)
                chunk[i][1] = v[v_at].reshape(n, h, d)


class VllmTileLayout(_CompiledPagesLayout):
    """vLLM's CPU attention backend, whatever kernels wrote its pages: each (block, head) tile
    is moved as its bytes, never decoded. Token `b * block_size + o` of a chunk holds, of each
    half of its block's tile (K's elements, then V's, `block_size * D` each), elements
    `[o * D, (o + 1) * D)`; a move covers whole blocks only (ValueError otherwise), so every
    tile moves whole and lands byte for byte in another block."""

    K_TRANSPOSED = False

    def __init__(self, kv_caches: Sequence[torch.Tensor], layer_groups: Sequence[int] | None = None,
                 kernels: bool = True) -> None:
        super().__init__(kv_caches, layer_groups, kernels)
        self.tokens_per_move = self.block_size

    def _halves(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nb, h, bs, d2 = kv.shape
        d = d2 // 2
        pages = _pages(kv, type(self).__name__)
        k = pages[..., :bs * d].unflatten(2, (bs, d)).transpose(1, 2)
        v = pages[..., bs * d:].unflatten(2, (bs, d)).transpose(1, 2)
        return k, v

    def _move_group(self, layers: Sequence[int], slots: torch.Tensor,
                    chunk: torch.Tensor | Sequence[torch.Tensor], to_cache: bool,
                    heads: tuple[int, int] | None = None) -> None:
        check_slots(slots, self.num_slots)
        bs = self.block_size
        if self._whole_blocks(slots) * bs != slots.shape[0]:
            raise ValueError(f"{type(self).__name__} moves whole blocks only ({bs} tokens each, from a block's "
                             f"first slot); got {slots.shape[0]} slots")
        super()._move_group(layers, slots, chunk, to_cache, heads)

    def _move_by_views(self, layers: Sequence[int], slots: torch.Tensor,
                       chunk: torch.Tensor | Sequence[torch.Tensor], to_cache: bool) -> None:
        bs = self.block_size
        blocks = self._block_ids(slots)
        for i, layer in enumerate(layers):
            k, v = self._kv_views[layer]
            ck, cv = chunk[i][0].unflatten(0, (-1, bs)), chunk[i][1].unflatten(0, (-1, bs))
            if to_cache:
                k[blocks], v[blocks] = ck, cv
            else:
                ck.copy_(k[blocks])
                cv.copy_(v[blocks])


class VllmFlashLayout(_SplitKVLayout):
    """vLLM's GPU FlashAttention backend: each token row of a (block, head) is `[K | V]`. The
    caches may be any strided views; writes go through them."""

    def _halves(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # vLLM's own split: kv_cache.transpose(1, 2).split(head_size, dim=-1).
        k, v = kv.transpose(1, 2).split(self.head_size, dim=-1)
        return k, v


LAYOUTS = ("cpu", "flash", "engine")

CPU_DECODED: dict[str, type[_SplitKVLayout]] = {"vec": VllmCpuLayout, "vec16": VllmCpuLayout, "amx": VllmAmxLayout}
"""vLLM's CPU attention kernels ("ISA") whose pages kvtier decodes to the canonical form, and
the layout that does; the pages of any other move as tiles (`VllmTileLayout`)."""

def cpu_page_decoder(isa: str, element_size: int, page_form: str = "auto") -> str | None:
    """Returns the ISA whose decoder reads pages written by vLLM's `isa` kernels into caches
    of `element_size`-byte elements, or None where they move as tiles (an ISA kvtier does not
    decode, 1-byte fp8 pages under "amx", or `page_form` "tiles"); ValueError for an unknown form."""
    if page_form not in PAGE_FORMS:
        raise ValueError(f"cpu_page_form must be one of {', '.join(PAGE_FORMS)}, got {page_form!r}")
    if page_form == "tiles" or isa not in CPU_DECODED or (isa == "amx" and element_size != 2):
        return None
    return isa


def vllm_layout_for(kv_caches: Sequence[torch.Tensor], backend: str,
                    layer_groups: Sequence[int] | None = None, decoder: str | None = "vec") -> PagedKVLayout:
    """Returns the layout of vLLM caches from attention backend `backend` ("cpu", "flash", or
    "engine" for `(2, num_blocks, block_size, H, D)`), each layer in KV cache group
    `layer_groups[layer]` (default: one group); on the CPU backend, pages decoded as `decoder`
    (`cpu_page_decoder`'s answer) or moved as tiles (None). ValueError names an unknown
    backend or decoder, a shape that does not fit it, or several groups where the backend has one."""
    if backend == "cpu":
        if decoder is None:
            return VllmTileLayout(kv_caches, layer_groups)
        if decoder not in CPU_DECODED:
            raise ValueError(f"no decoder for vLLM's {decoder!r} CPU pages; known: {', '.join(CPU_DECODED)}")
        return CPU_DECODED[decoder](kv_caches, layer_groups)
    if backend == "flash":
        return VllmFlashLayout(kv_caches, layer_groups)
    if layer_groups is not None and max(layer_groups) > 0:
        raise ValueError(f"the {backend!r} layout has one KV cache group")
    if backend == "engine":
        return EngineLayout(kv_caches)
    raise ValueError(f"unknown vLLM KV layout {backend!r}; known: {', '.join(LAYOUTS)}")
