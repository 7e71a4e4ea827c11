"""vLLM's paged KV layouts behind kvtier's one interface (`engine.kv_cache.PagedKVLayout`).

vLLM 0.32 gives a connector, per attention layer, a tensor of logical shape
`(num_blocks, num_kv_heads, block_size, 2 * head_size)`; what the last two axes mean depends
on the attention backend:
- CPU (`VllmCpuLayout`, the "vec" kernels): each (block, head) page of `block_size * 2 *
  head_size` elements holds K transposed, `(head_size, block_size)`, then V,
  `(block_size, head_size)` (vLLM's `cpu_attn_reshape_and_cache` writes it so;
  tests/vllm/test_cpu_layout_kernel.py checks it against that kernel).
- GPU FlashAttention (`VllmFlashLayout`): each token row is `[K | V]`, K the first
  `head_size` values; the tensor may be a strided view of a token-major allocation.
kvtier's engine layout `(2, num_blocks, block_size, H, D)` is `engine.kv_cache.EngineLayout`.
Slot ids are the same everywhere: `block * block_size + offset`. Gathers and scatters are
one advanced-indexing op per layer and per K/V, no per-token loop. This module never
imports vllm.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kv_cache import EngineLayout, PagedKVLayout, check_slots


class _SplitKVLayout(PagedKVLayout):
    """Per layer `(num_blocks, H, block_size, 2*D)`; subclasses say where K and V sit."""

    def __init__(self, kv_caches: Sequence[torch.Tensor]) -> None:
        if len(kv_caches) == 0:
            raise ValueError("kv_caches is empty")
        ref = kv_caches[0]
        if ref.dim() != 4 or ref.shape[3] % 2:
            raise ValueError(f"{type(self).__name__}: each kv_cache must be (num_blocks, num_kv_heads, "
                             f"block_size, 2 * head_size), got {tuple(ref.shape)}")
        nb, h, bs, d2 = ref.shape
        super().__init__(kv_caches, bs, nb, h, d2 // 2)

    def _gather_kv(self, kv: torch.Tensor, blocks: torch.Tensor,
                   offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (K, V) of the given positions of one layer, each `(T, H, D)`."""
        raise NotImplementedError

    def _scatter_kv(self, kv: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes K and V `(T, H, D)` into the given positions of one layer, in place."""
        raise NotImplementedError

    def _positions(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        check_slots(slots, self.num_slots)  # host-side slots: no device sync
        slots = slots.to(self.device, non_blocking=True)
        return torch.div(slots, self.block_size, rounding_mode="floor"), slots % self.block_size

    def gather_chunk(self, slots: torch.Tensor) -> torch.Tensor:
        blocks, offsets = self._positions(slots)
        out = torch.empty(self.chunk_shape(self.num_layers, slots.numel()), dtype=self.dtype, device=self.device)
        for layer, kv in enumerate(self.kv_caches):
            out[layer, 0], out[layer, 1] = self._gather_kv(kv, blocks, offsets)
        return out

    def gather_layers(self, slots: torch.Tensor) -> list[torch.Tensor]:
        blocks, offsets = self._positions(slots)
        return [torch.stack(self._gather_kv(kv, blocks, offsets)).unsqueeze(0) for kv in self.kv_caches]

    def scatter_chunk(self, slots: torch.Tensor, chunk: torch.Tensor) -> None:
        expected = self.chunk_shape(self.num_layers, slots.numel())
        if tuple(chunk.shape) != expected:
            raise ValueError(f"chunk shape {tuple(chunk.shape)} does not match expected {expected}")
        blocks, offsets = self._positions(slots)
        chunk = chunk.to(device=self.device, dtype=self.dtype, non_blocking=True)
        for layer, kv in enumerate(self.kv_caches):
            self._scatter_kv(kv, blocks, offsets, chunk[layer, 0], chunk[layer, 1])

    def scatter_layer(self, layer: int, slots: torch.Tensor, layer_kv: torch.Tensor) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.num_layers})")
        expected = (2, slots.numel(), self.num_kv_heads, self.head_size)
        if tuple(layer_kv.shape) != expected:
            raise ValueError(f"layer shape {tuple(layer_kv.shape)} does not match {expected}")
        blocks, offsets = self._positions(slots)
        src = layer_kv.to(device=self.device, dtype=self.dtype, non_blocking=True)
        self._scatter_kv(self.kv_caches[layer], blocks, offsets, src[0], src[1])


class VllmCpuLayout(_SplitKVLayout):
    """vLLM's CPU attention backend: per (block, head) page, K^T `(D, block_size)` then V
    `(block_size, D)`. The caches must be contiguous (pages are addressed by offset)."""

    def __init__(self, kv_caches: Sequence[torch.Tensor]) -> None:
        super().__init__(kv_caches)
        if not all(kv.is_contiguous() for kv in kv_caches):
            raise ValueError("VllmCpuLayout needs contiguous kv_caches (pages are addressed by offset)")

    def _halves(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns views (K^T `(B, H, D, bs)`, V `(B, H, bs, D)`) of one layer's pages."""
        d, bs = self.head_size, self.block_size
        pages = kv.view(self.num_blocks, self.num_kv_heads, 2 * bs * d)
        return pages[:, :, :d * bs].unflatten(2, (d, bs)), pages[:, :, d * bs:].unflatten(2, (bs, d))

    def _gather_kv(self, kv: torch.Tensor, blocks: torch.Tensor,
                   offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kt, v = self._halves(kv)
        return kt[blocks, :, :, offsets], v[blocks, :, offsets]

    def _scatter_kv(self, kv: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor) -> None:
        kt, vv = self._halves(kv)
        kt[blocks, :, :, offsets] = k
        vv[blocks, :, offsets] = v


class VllmFlashLayout(_SplitKVLayout):
    """vLLM's GPU FlashAttention backend: each token row of a (block, head) is `[K | V]`; the
    caches may be any strided view (writes go through the view)."""

    def _gather_kv(self, kv: torch.Tensor, blocks: torch.Tensor,
                   offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = kv[blocks, :, offsets]  # (T, H, 2D)
        d = self.head_size
        return rows[..., :d], rows[..., d:]

    def _scatter_kv(self, kv: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor) -> None:
        kv[blocks, :, offsets] = torch.cat((k, v), dim=-1)


LAYOUTS = ("cpu", "flash", "engine")


def vllm_layout_for(kv_caches: Sequence[torch.Tensor], backend: str) -> PagedKVLayout:
    """Returns the layout of vLLM caches from attention backend `backend` ("cpu", "flash", or
    "engine" for `(2, num_blocks, block_size, H, D)`); ValueError names an unknown backend or
    a shape that does not fit it."""
    if backend == "cpu":
        return VllmCpuLayout(kv_caches)
    if backend == "flash":
        return VllmFlashLayout(kv_caches)
    if backend == "engine":
        return EngineLayout(kv_caches)
    raise ValueError(f"unknown vLLM KV layout {backend!r}; known: {', '.join(LAYOUTS)}")

