"""The one owner of the paged KV layout: where a token's K/V lives, how many bytes it takes,
and the vectorised moves between the paged caches and chunk tensors.

Slots: the token at logical position `p` of a sequence with block table `table` lives in
flat slot `table[p // block_size] * block_size + p % block_size`; `slot_mapping` is the one
place that computes it (the model runner's batched mapping and `request_slots` both call it).
Slot ids are logical, the same for every layout; a layout decides where a slot's K/V sits in
memory. Chunks: one tensor `(num_layers, 2, num_tokens, num_kv_heads, head_size)`
(docs/architecture.md, "Chunks, keys and codecs"). A `PagedKVLayout` is one way of laying the caches
out; callers use only its interface, so another engine's layout (vLLM's CPU one) is another
implementation. `EngineLayout` is this engine's:
per layer `(2, num_blocks, block_size, num_kv_heads, head_size)`. No per-token loops: one
index_select / index_copy_ per layer, or a single one when the layers are evenly spaced
views of one allocation.
"""

from __future__ import annotations

import math
import mmap
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

import torch


class KVShape(Protocol):
    """What sizes a token's K/V: a `ModelConfig` before the caches exist, or a layout."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_size(self) -> int: ...


class KeyedModel(KVShape, Protocol):
    """A model's K/V sizes and its identity, what the connector keys its chunks by:
    engine/model_config.py's `ModelConfig`, or connector/vllm/setup.py's `VllmModel` (any
    architecture vLLM runs)."""

    @property
    def fingerprint(self) -> str: ...


def kv_bytes_per_block(shape: KVShape, block_size: int, dtype: torch.dtype) -> int:
    """Returns the bytes `block_size` tokens' K/V take across all layers (K and V): with
    `block_size=1`, bytes per token. The one formula, used to size the pool and by layouts."""
    return shape.num_layers * 2 * block_size * shape.num_kv_heads * shape.head_size * dtype.itemsize


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Returns a zero-filled contiguous tensor of `shape` (the KV pool), page aligned on the
    CPU. There it is an anonymous mapping whose pages stay the kernel's zero pages until
    written, so a pool larger than a run uses costs neither the fill (torch.zeros writes every
    page, at every engine start) nor resident memory. The price is a page fault on a block's
    first write (a warm load into never-used blocks takes several times as long as into
    written ones), which is why the block pool hands out written blocks first where
    it can (engine/block_pool.py `free_blocks`, `reset_prefix_cache`). Its pages are small ones
    (MADV_NOHUGEPAGE): a first write into a huge page zeroes 2 MiB, so a prefill into fresh
    blocks spends far more kernel time on huge pages than on 4 KiB ones, and decode is no
    slower (docs/results.md, "Measurements behind the code's choices")."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    area = mmap.mmap(-1, max(nbytes, 1))  # the tensor holds the mapping while it lives
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        area.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(area, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


def slot_mapping(block_tables: torch.Tensor, seq_index: torch.Tensor, positions: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """Returns the flat slot of each token: `table[p // bs] * bs + p % bs`.

    `block_tables` is [num_seqs, max_blocks] (int64), `seq_index` and `positions` are [T];
    the result is [T] int64 on the tables' device. One gather, no Python loop over tokens.
    """
    block_ids = block_tables[seq_index, torch.div(positions, block_size, rounding_mode="floor")]
    return block_ids * block_size + positions % block_size


def request_slots(block_ids: Sequence[int] | torch.Tensor, block_size: int, start: int, end: int,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """Returns the int64 slots of positions [start, end) of one sequence whose block table is
    `block_ids` (on the table's device, host for a list, unless `device` says otherwise).
    Raises ValueError if the range is not covered."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not 0 <= start <= end:
        raise ValueError(f"token range must satisfy 0 <= start <= end, got [{start}, {end})")
    table = torch.as_tensor(block_ids, dtype=torch.long)
    if table.dim() != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {tuple(table.shape)}")
    if end > table.numel() * block_size:
        raise ValueError(f"token range [{start}, {end}) exceeds the {table.numel()} blocks of "
                         f"{block_size} tokens in the block table")
    positions = torch.arange(start, end, dtype=torch.long, device=table.device)
    slots = slot_mapping(table.view(1, -1), torch.zeros_like(positions), positions, block_size)
    return slots if device is None else slots.to(device)


def check_slots(slots: torch.Tensor, num_slots: int) -> None:
    """Raises ValueError unless `slots` is 1-D int64 within [0, num_slots). Callers pass host
    slots, so min/max here cost no device sync (checked before any move)."""
    if slots.dim() != 1 or slots.dtype != torch.long:
        raise ValueError(f"slots must be a 1-D int64 tensor, got {slots.dtype} {tuple(slots.shape)}")
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
        raise ValueError(f"slots must lie in [0, {num_slots}), the kv_cache's slot range")


def consecutive_start(slots: torch.Tensor) -> int | None:
    """Returns the first of `slots` when they are one run of consecutive slots (a request whose
    blocks are adjacent), else None; None for device slots too (reading them would sync)."""
    if slots.device.type != "cpu" or slots.numel() == 0:
        return None
    first = int(slots[0])
    if int(slots[-1]) - first != slots.numel() - 1:
        return None
    return first if slots.numel() == 1 or bool((slots.diff() == 1).all()) else None


class PagedKVLayout(ABC):
    """The per-layer paged caches of one engine and the moves into and out of them.

    Guarantees: gathers return new tensors on the caches' device and dtype and never change
    the caches; scatters change only the given slots, cast to the caches' dtype and device
    (non-blocking moves), and check shapes and slots before anything is written (a mismatch
    raises ValueError, nothing changed).
    """

    def __init__(self, kv_caches: Sequence[torch.Tensor], block_size: int, num_blocks: int,
                 num_kv_heads: int, head_size: int) -> None:
        if len(kv_caches) == 0:
            raise ValueError("kv_caches is empty")
        ref = kv_caches[0]
        for i, kv in enumerate(kv_caches):
            if kv.shape != ref.shape or kv.dtype != ref.dtype or kv.device != ref.device:
                raise ValueError(f"kv_caches[{i}] differs in shape, dtype or device from layer 0")
        self.kv_caches = list(kv_caches)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size

    @property
    def num_layers(self) -> int:
        return len(self.kv_caches)

    @property
    def dtype(self) -> torch.dtype:
        return self.kv_caches[0].dtype

    @property
    def device(self) -> torch.device:
        return self.kv_caches[0].device

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def bytes_per_token(self) -> int:
        """Returns the bytes one token's K/V takes across all layers (K and V)."""
        return kv_bytes_per_block(self, 1, self.dtype)

    def bytes_per_block(self) -> int:
        """Returns the bytes one block's K/V takes across all layers (K and V)."""
        return kv_bytes_per_block(self, self.block_size, self.dtype)

    def slots(self, block_ids: Sequence[int] | torch.Tensor, start: int, end: int,
              device: torch.device | str | None = None) -> torch.Tensor:
        """Returns the int64 slots (host for a list table) of positions [start, end) of a
        sequence with block table `block_ids`; ValueError if the table does not cover them."""
        return request_slots(block_ids, self.block_size, start, end, device)

    def group_slots(self, block_ids: Sequence[Sequence[int]], start: int, end: int) -> torch.Tensor:
        """Returns the host slots of positions [start, end) of a sequence given its block table
        per KV cache group: 1-D here, where every layer is in one group; ValueError for another
        number of groups or a table that does not cover the range. Layouts of several groups
        return `(num_groups, n)` slots (connector/vllm/layouts.py)."""
        if len(block_ids) != 1:
            raise ValueError(f"{type(self).__name__} has one KV cache group, got block tables for {len(block_ids)}")
        return request_slots(block_ids[0], self.block_size, start, end)

    def slot_mapping(self, block_tables: torch.Tensor, seq_index: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
        """Returns the batched flat slot of each token (see the module's `slot_mapping`)."""
        return slot_mapping(block_tables, seq_index, positions, self.block_size)

    def chunk_shape(self, num_layers: int, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Returns `(num_layers, 2, num_tokens, num_kv_heads, head_size)`, a chunk's shape."""
        return (num_layers, 2, num_tokens, self.num_kv_heads, self.head_size)

    @abstractmethod
    def gather_chunk(self, slots: torch.Tensor) -> torch.Tensor:
        """Returns a new contiguous chunk `(num_layers, 2, len(slots), H, D)` holding the K/V
        of `slots` from every layer, on the caches' device and dtype."""

    @abstractmethod
    def scatter_chunk(self, slots: torch.Tensor, chunk: torch.Tensor) -> None:
        """Writes `chunk` `(num_layers, 2, len(slots), H, D)` into `slots` of every layer, in
        place; a mismatched shape raises ValueError before anything is written."""

    def scatter_heads(self, slots: torch.Tensor, pieces: Sequence[torch.Tensor]) -> None:
        """Writes one chunk given as `pieces` along the head axis (each `(num_layers, 2,
        len(slots), h_i, D)`, in head order, the h_i adding up to H) as `scatter_chunk` does.
        Here they are joined first; a layout that can write each piece where it goes skips
        that copy."""
        self.head_widths(slots.shape[-1], pieces)
        self.scatter_chunk(slots, torch.cat(list(pieces), dim=3))

    def head_widths(self, num_tokens: int, pieces: Sequence[torch.Tensor]) -> list[int]:
        """Returns how many KV heads each of `pieces` holds; ValueError unless they make one
        chunk of `num_tokens` tokens (`scatter_heads`)."""
        want = self.chunk_shape(self.num_layers, num_tokens)
        widths = [p.shape[3] if p.dim() == 5 else 0 for p in pieces]
        if sum(widths) != want[3] or any(tuple(p.shape) != want[:3] + (w, want[4]) for p, w in zip(pieces, widths)):
            raise ValueError(f"pieces {[tuple(p.shape) for p in pieces]} do not make a chunk of {want}")
        return widths

    @abstractmethod
    def gather_layers(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """Returns one new tensor `(1, 2, len(slots), H, D)` per layer holding the K/V of
        `slots` (layerwise storage: each is a whole allocation a memory tier can keep without
        a copy)."""

    @abstractmethod
    def scatter_layer(self, layer: int, slots: torch.Tensor, layer_kv: torch.Tensor) -> None:
        """Writes `layer_kv` `(2, len(slots), H, D)` into `slots` of layer `layer`, in place;
        a mismatched shape raises ValueError before anything is written."""

    # Whether `chunk_views` can give views of the caches' own memory (host memory, contiguous).
    writes_in_place: bool = False
    # Moves cover whole runs of this many slots from a multiple of it (1: any slots; a layout
    # that moves whole blocks, e.g. connector/vllm/layouts.py's tiles: its block size).
    tokens_per_move: int = 1

    def chunk_views(self, slots: torch.Tensor, before: int = 0, after: int = 0) -> list[memoryview]:
        """Returns writable byte views of where the bytes of a chunk `(num_layers, 2, before +
        len(slots) + after, H, D)` go, in its C order, when its tokens [before, before +
        len(slots)) are scattered to `slots`: bytes written end to end through them land where
        `scatter_chunk` puts them, and the `before` / `after` tokens of each layer and K/V in
        scratch memory. Raises ValueError for bad slots or when not `writes_in_place`."""
        raise ValueError(f"{type(self).__name__} cannot be written in place")


class EngineLayout(PagedKVLayout):
    """Per layer `(2, num_blocks, block_size, num_kv_heads, head_size)` (K then V)."""

    def __init__(self, kv_caches: Sequence[torch.Tensor]) -> None:
        if len(kv_caches) == 0:
            raise ValueError("kv_caches is empty")
        ref = kv_caches[0]
        if ref.dim() != 5 or ref.shape[0] != 2:
            raise ValueError("each kv_cache must be (2, num_blocks, block_size, num_kv_heads, head_size), "
                             f"got {tuple(ref.shape)}")
        _, nb, bs, h, d = ref.shape
        super().__init__(kv_caches, bs, nb, h, d)
        self._stacked = self._stacked_view()
        self.writes_in_place = self.device.type == "cpu" and all(kv.is_contiguous() for kv in kv_caches)
        # per layer, K then V: its bytes, for chunk_views
        self._planes = [kv[i].reshape(-1).view(torch.uint8).numpy().data
                        for kv in kv_caches for i in (0, 1)] if self.writes_in_place else []

    def _flat(self, kv: torch.Tensor) -> torch.Tensor:
        """Returns one layer's cache as `(2, num_slots, H, D)`: a view for a contiguous cache
        (scatters need that, so their writes land in the cache), else maybe a copy."""
        return kv.reshape(2, self.num_slots, self.num_kv_heads, self.head_size)

    def _stacked_view(self) -> torch.Tensor | None:
        """Returns a `(num_layers, 2, num_slots, H, D)` view over all layers when they are
        evenly spaced, contiguous views of one storage (the usual single allocation), else None."""
        caches = self.kv_caches
        ref = caches[0]
        if not all(kv.is_contiguous() for kv in caches):
            return None
        base = ref.untyped_storage().data_ptr()
        if any(kv.untyped_storage().data_ptr() != base for kv in caches):
            return None
        offsets = [kv.storage_offset() for kv in caches]
        step = offsets[1] - offsets[0] if len(offsets) > 1 else ref.numel()
        # Layers must not overlap: each is `numel` elements long.
        if step < ref.numel() or any(b - a != step for a, b in zip(offsets, offsets[1:])):
            return None
        flat = self._flat(ref)
        return torch.as_strided(ref, (len(caches), *flat.shape), (step, *flat.stride()), offsets[0])

    def gather_chunk(self, slots: torch.Tensor) -> torch.Tensor:
        check_slots(slots, self.num_slots)  # before the move: host-side slots need no device sync
        first = consecutive_start(slots) if self._stacked is not None else None
        slots = slots.to(self.device, non_blocking=True)
        if self._stacked is not None:
            if first is not None:  # one strided copy instead of an index per slot
                run = self._stacked[:, :, first:first + slots.numel()]
                return torch.empty(run.shape, dtype=self.dtype, device=self.device).copy_(run)
            return self._stacked.index_select(2, slots)
        out = torch.empty(self.chunk_shape(self.num_layers, slots.numel()), dtype=self.dtype, device=self.device)
        for layer, kv in enumerate(self.kv_caches):
            torch.index_select(self._flat(kv), 1, slots, out=out[layer])
        return out

    def scatter_chunk(self, slots: torch.Tensor, chunk: torch.Tensor) -> None:
        if not all(kv.is_contiguous() for kv in self.kv_caches):
            raise ValueError("scatter_chunk needs contiguous kv_caches (a copy would drop the write)")
        expected = self.chunk_shape(self.num_layers, slots.numel())
        if tuple(chunk.shape) != expected:
            raise ValueError(f"chunk shape {tuple(chunk.shape)} does not match expected {expected}")
        check_slots(slots, self.num_slots)
        first = consecutive_start(slots) if self._stacked is not None else None
        slots = slots.to(self.device, non_blocking=True)
        chunk = chunk.to(device=self.device, dtype=self.dtype, non_blocking=True)
        if self._stacked is not None:
            # Every layer in one op: from a background thread each op pays an OpenMP team's
            # start, so per-layer ops spend much of their time starting teams (benchmarks/bench_load.py).
            if first is not None:
                self._stacked[:, :, first:first + slots.numel()].copy_(chunk)
            else:
                self._stacked.index_copy_(2, slots, chunk)
            return
        for layer, kv in enumerate(self.kv_caches):
            self._flat(kv).index_copy_(1, slots, chunk[layer])

    def gather_layers(self, slots: torch.Tensor) -> list[torch.Tensor]:
        check_slots(slots, self.num_slots)
        slots = slots.to(self.device, non_blocking=True)
        return [self._flat(kv).index_select(1, slots).unsqueeze(0) for kv in self.kv_caches]

    def scatter_layer(self, layer: int, slots: torch.Tensor, layer_kv: torch.Tensor) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.num_layers})")
        kv_cache = self.kv_caches[layer]
        if not kv_cache.is_contiguous():
            raise ValueError("scatter_layer needs a contiguous kv_cache (a copy would drop the write)")
        expected = (2, slots.numel(), self.num_kv_heads, self.head_size)
        if tuple(layer_kv.shape) != expected:
            raise ValueError(f"layer shape {tuple(layer_kv.shape)} does not match {expected}")
        check_slots(slots, self.num_slots)
        slots = slots.to(self.device, non_blocking=True)
        src = layer_kv.to(device=self.device, dtype=self.dtype, non_blocking=True)
        self._flat(kv_cache).index_copy_(1, slots, src)

    def chunk_views(self, slots: torch.Tensor, before: int = 0, after: int = 0) -> list[memoryview]:
        """One view per run of consecutive slots, per layer and K/V (see the base class)."""
        if not self.writes_in_place:
            raise ValueError("chunk_views needs contiguous kv_caches in host memory")
        check_slots(slots, self.num_slots)
        token = self.num_kv_heads * self.head_size * self.dtype.itemsize
        starts: list[int] = []
        ends: list[int] = []
        for s in slots.tolist():
            if ends and ends[-1] == s:
                ends[-1] = s + 1
            else:
                starts.append(s)
                ends.append(s + 1)
        pad = (before + after) * token
        scratch = memoryview(bytearray(pad * len(self._planes)))
        views: list[memoryview] = []
        for i, plane in enumerate(self._planes):
            if before:
                views.append(scratch[i * pad:i * pad + before * token])
            views.extend(plane[a * token:b * token] for a, b in zip(starts, ends))
            if after:
                views.append(scratch[i * pad + before * token:(i + 1) * pad])
        return views


def layout_for(kv_caches: Sequence[torch.Tensor]) -> PagedKVLayout:
    """Returns the layout of this engine's caches; ValueError names a shape it does not know."""
    return EngineLayout(kv_caches)
