"""vLLM's paged KV layouts behind kvtier's one interface (`engine.kv_cache.PagedKVLayout`).

vLLM 0.32 gives a connector, per attention layer, a tensor of logical shape
`(num_blocks, num_kv_heads, block_size, 2 * head_size)`; what the last two axes mean depends
on the attention backend (docs/vllm.md):
- CPU (`VllmCpuLayout`, the "vec"/"vec16" kernels): each (block, head) page of
  `block_size * 2 * head_size` elements holds K transposed, `(head_size, block_size)`, then V,
  `(block_size, head_size)` (vLLM's `cpu_attn_reshape_and_cache` writes it so;
  tests/vllm/test_cpu_layout_kernel.py checks it against that kernel). The AMX kernel packs
  pages differently and is not supported.
- GPU FlashAttention (`VllmFlashLayout`): each token row is `[K | V]`, K the first
  `head_size` values; the tensor may be any strided view (vLLM's `LBNHC` allocation is
  token-major `(num_blocks, block_size, H, 2D)` permuted).
kvtier's engine layout `(2, num_blocks, block_size, H, D)` is `engine.kv_cache.EngineLayout`.
Slot ids are the same everywhere: `block * block_size + offset`.

Each layout only says where K and V sit: per layer, two strided views `(num_blocks,
block_size, H, D)` of the cache, one for K and one for V (vLLM's own split). A gather or
scatter is then one advanced-indexing op per layer and K/V over (block, offset), with no
per-token loop; writes go through the views into the caller's tensors. (One op over all
layers through a stacked `as_strided` view was no faster, so there is none.) On CPU,
`VllmCpuLayout` moves whole chunks in one compiled call instead (engine/csrc/kv_pages.cpp):
its K^T pages make the indexing path slow. This module never imports vllm.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

import torch

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
        """Returns views (never copies) K and V of one layer's cache, each `(num_blocks,
        block_size, H, D)`; ValueError if the cache's strides do not allow them."""

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


class VllmCpuLayout(_SplitKVLayout):
    """vLLM's CPU attention backend ("vec"/"vec16" ISA): per (block, head) page, K^T
    `(D, block_size)` then V `(block_size, D)`. Each page must be contiguous, as the kernel
    addresses it by offset; blocks and heads may have any strides.

    On CPU the copies run in engine/csrc's `copy_kv_pages` (several times faster than PyTorch's
    indexing through the K^T views; `benchmarks/bench_load.py`'s vllm-cpu rows) where it builds, or
    `kernels=False`; elsewhere through the views."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], layer_groups: Sequence[int] | None = None,
                 kernels: bool = True) -> None:
        super().__init__(kv_caches, layer_groups)
        same_strides = all(kv.stride() == self.kv_caches[0].stride() for kv in self.kv_caches)
        self._ops = cpu_ops.load() if kernels and same_strides and self.device.type == "cpu" else None

    def _move_group(self, layers: Sequence[int], slots: torch.Tensor,
                    chunk: torch.Tensor | Sequence[torch.Tensor], to_cache: bool) -> None:
        if self._ops is None:
            super()._move_group(layers, slots, chunk, to_cache)
            return
        check_slots(slots, self.num_slots)
        slots = slots.contiguous()
        if isinstance(chunk, torch.Tensor):
            self._ops.copy_kv_pages([self.kv_caches[layer] for layer in layers], chunk, slots, to_cache)
            return
        for layer, per_layer in zip(layers, chunk, strict=True):
            self._ops.copy_kv_pages([self.kv_caches[layer]], per_layer[None], slots, to_cache)

    def _halves(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nb, h, bs, d2 = kv.shape
        if kv.stride(3) != 1 or (bs > 1 and kv.stride(2) != d2):
            raise ValueError(f"VllmCpuLayout needs each (block, head) page contiguous, got strides {kv.stride()}")
        d = d2 // 2
        # vLLM's split: kv.view(nb, h, 2 * bs, d).chunk(2, dim=2), K's half read as (d, bs).
        pages = kv.view(nb, h, 2 * bs * d)
        k = pages[..., :d * bs].unflatten(2, (d, bs)).permute(0, 3, 1, 2)
        v = pages[..., d * bs:].unflatten(2, (bs, d)).transpose(1, 2)
        return k, v


class VllmFlashLayout(_SplitKVLayout):
    """vLLM's GPU FlashAttention backend: each token row of a (block, head) is `[K | V]`. The
    caches may be any strided views; writes go through them."""

    def _halves(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # vLLM's own split: kv_cache.transpose(1, 2).split(head_size, dim=-1).
        k, v = kv.transpose(1, 2).split(self.head_size, dim=-1)
        return k, v


LAYOUTS = ("cpu", "flash", "engine")


CPU_ISAS = ("vec", "vec16")
"""vLLM's CPU attention kernels whose pages `VllmCpuLayout` reads (their "amx" and "neon" pages
are laid out otherwise: docs/vllm.md, "Limits")."""


def vllm_layout_for(kv_caches: Sequence[torch.Tensor], backend: str,
                    layer_groups: Sequence[int] | None = None, isa: str | None = None) -> PagedKVLayout:
    """Returns the layout of vLLM caches from attention backend `backend` ("cpu", "flash", or
    "engine" for `(2, num_blocks, block_size, H, D)`), each layer in KV cache group
    `layer_groups[layer]` (default: one group), the CPU backend's pages written by vLLM's `isa`
    kernels (default: "vec"); ValueError names an unknown backend, kernels whose pages it does
    not read, a shape that does not fit it, or several groups where the backend has one."""
    if backend == "cpu":
        if isa is not None and isa not in CPU_ISAS:
            raise ValueError(f"KVTierConnector: vLLM's CPU attention uses the {isa!r} kernels here, whose KV "
                             "layout kvtier does not support; use float32 (or a CPU without AMX)")
        return VllmCpuLayout(kv_caches, layer_groups)
    if backend == "flash":
        return VllmFlashLayout(kv_caches, layer_groups)
    if layer_groups is not None and max(layer_groups) > 0:
        raise ValueError(f"the {backend!r} layout has one KV cache group")
    if backend == "engine":
        return EngineLayout(kv_caches)
    raise ValueError(f"unknown vLLM KV layout {backend!r}; known: {', '.join(LAYOUTS)}")
