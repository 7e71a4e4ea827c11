"""Pure, vectorised moves between the engine's paged kv_caches and kvstore chunk tensors.

Engine side: one tensor per layer, `(2, num_blocks, block_size, num_kv_heads, head_size)`
(docs/architecture.md, "Engine"). Chunk side: one tensor
`(num_layers, 2, num_tokens, num_kv_heads, head_size)` (docs/architecture.md, "Chunks, keys and
codecs"). Tokens are addressed by flat slot ids `block_id * block_size + pos % block_size`, so
any block_size/chunk_size alignment is just a different slot vector. No per-token loops: one
index_select / index_copy_ per layer, or a single one when the layers are views of one stacked
allocation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def slots_for(
    block_ids: Sequence[int] | torch.Tensor,
    block_size: int,
    start: int,
    end: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Returns the int64 slot ids of logical token positions `[start, end)` of a sequence
    whose block table is `block_ids`. Raises ValueError if the range is not covered."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not 0 <= start <= end:
        raise ValueError(f"token range must satisfy 0 <= start <= end, got [{start}, {end})")
    table = torch.as_tensor(block_ids, dtype=torch.long)
    if table.dim() != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {tuple(table.shape)}")
    if end > table.numel() * block_size:
        raise ValueError(
            f"token range [{start}, {end}) exceeds the {table.numel()} blocks of "
            f"{block_size} tokens in the block table"
        )
    pos = torch.arange(start, end, dtype=torch.long, device=table.device)
    slots = table[pos // block_size] * block_size + pos % block_size
    return slots if device is None else slots.to(device)


def _check_caches(kv_caches: Sequence[torch.Tensor]) -> None:
    if len(kv_caches) == 0:
        raise ValueError("kv_caches is empty")
    ref = kv_caches[0]
    if ref.dim() != 5 or ref.shape[0] != 2:
        raise ValueError(
            "each kv_cache must be (2, num_blocks, block_size, num_kv_heads, head_size), "
            f"got {tuple(ref.shape)}"
        )
    for i, kv in enumerate(kv_caches):
        if kv.shape != ref.shape or kv.dtype != ref.dtype or kv.device != ref.device:
            raise ValueError(f"kv_caches[{i}] differs in shape, dtype or device from layer 0")


def _stacked_view(kv_caches: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Returns a `(num_layers, 2, num_slots, H, D)` view over all layers when they are evenly
    spaced, contiguous views of one storage (the usual single allocation), else None."""
    ref = kv_caches[0]
    if not all(kv.is_contiguous() for kv in kv_caches):
        return None
    base = ref.untyped_storage().data_ptr()
    if any(kv.untyped_storage().data_ptr() != base for kv in kv_caches):
        return None
    offsets = [kv.storage_offset() for kv in kv_caches]
    if len(offsets) > 1:
        step = offsets[1] - offsets[0]
        # Layers must not overlap: each is `numel` elements long.
        if step < ref.numel() or any(
            b - a != step for a, b in zip(offsets, offsets[1:])
        ):
            return None
    else:
        step = ref.numel()
    two, nb, bs, h, d = ref.shape
    flat = ref.reshape(two, nb * bs, h, d)
    return torch.as_strided(
        ref, (len(kv_caches), two, nb * bs, h, d), (step, *flat.stride()), offsets[0]
    )


def _check_slots(slots: torch.Tensor, num_slots: int) -> None:
    if slots.dim() != 1 or slots.dtype != torch.long:
        raise ValueError(f"slots must be a 1-D int64 tensor, got {slots.dtype} {tuple(slots.shape)}")
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
        raise ValueError(f"slots must lie in [0, {num_slots}), the kv_cache's slot range")


def gather_chunk(kv_caches: Sequence[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """Returns a new contiguous chunk `(num_layers, 2, len(slots), H, D)` holding the K/V of
    `slots` from every layer, on the caches' device and dtype (the caches are not changed)."""
    _check_caches(kv_caches)
    two, nb, bs, h, d = kv_caches[0].shape
    _check_slots(slots, nb * bs)  # before the move: host-side slots need no device sync
    slots = slots.to(kv_caches[0].device, non_blocking=True)
    stacked = _stacked_view(kv_caches)
    if stacked is not None:
        return stacked.index_select(2, slots)
    out = torch.empty(
        (len(kv_caches), two, slots.numel(), h, d),
        dtype=kv_caches[0].dtype,
        device=kv_caches[0].device,
    )
    for layer, kv in enumerate(kv_caches):
        torch.index_select(kv.reshape(two, nb * bs, h, d), 1, slots, out=out[layer])
    return out


def scatter_chunk(
    kv_caches: Sequence[torch.Tensor], slots: torch.Tensor, chunk: torch.Tensor
) -> None:
    """Writes `chunk` `(num_layers, 2, len(slots), H, D)` into `slots` of every layer, in place,
    casting to the caches' dtype/device. Only those slots change; shapes are checked first
    so a mismatched chunk raises ValueError before anything is written."""
    _check_caches(kv_caches)
    if not all(kv.is_contiguous() for kv in kv_caches):
        raise ValueError("scatter_chunk needs contiguous kv_caches (a copy would drop the write)")
    two, nb, bs, h, d = kv_caches[0].shape
    expected = (len(kv_caches), two, slots.numel(), h, d)
    if tuple(chunk.shape) != expected:
        raise ValueError(f"chunk shape {tuple(chunk.shape)} does not match expected {expected}")
    dev = kv_caches[0].device
    _check_slots(slots, nb * bs)
    slots = slots.to(dev, non_blocking=True)
    chunk = chunk.to(device=dev, dtype=kv_caches[0].dtype, non_blocking=True)
    stacked = _stacked_view(kv_caches)
    if stacked is not None:
        stacked.index_copy_(2, slots, chunk)
        return
    for layer, kv in enumerate(kv_caches):
        # reshape of a contiguous cache is a view, so index_copy_ lands in the cache itself.
        flat = kv.view(two, nb * bs, h, d)
        flat.index_copy_(1, slots, chunk[layer])


def gather_layers(kv_caches: Sequence[torch.Tensor], slots: torch.Tensor) -> list[torch.Tensor]:
    """Returns one new tensor `(1, 2, len(slots), H, D)` per layer holding the K/V of `slots`
    (layerwise storage: each is a whole allocation a memory tier can keep without a copy)."""
    _check_caches(kv_caches)
    two, nb, bs, h, d = kv_caches[0].shape
    _check_slots(slots, nb * bs)
    slots = slots.to(kv_caches[0].device, non_blocking=True)
    return [kv.reshape(two, nb * bs, h, d).index_select(1, slots).unsqueeze(0) for kv in kv_caches]


def scatter_layer(kv_cache: torch.Tensor, slots: torch.Tensor, layer_kv: torch.Tensor) -> None:
    """Writes `layer_kv` `(2, len(slots), H, D)` into `slots` of one layer's cache, in place,
    casting to its dtype/device; a mismatched shape raises ValueError before anything is written."""
    _check_caches([kv_cache])
    if not kv_cache.is_contiguous():
        raise ValueError("scatter_layer needs a contiguous kv_cache (a copy would drop the write)")
    two, nb, bs, h, d = kv_cache.shape
    if tuple(layer_kv.shape) != (two, slots.numel(), h, d):
        raise ValueError(f"layer shape {tuple(layer_kv.shape)} does not match {(two, slots.numel(), h, d)}")
    _check_slots(slots, nb * bs)
    slots = slots.to(kv_cache.device, non_blocking=True)
    src = layer_kv.to(device=kv_cache.device, dtype=kv_cache.dtype, non_blocking=True)
    kv_cache.view(two, nb * bs, h, d).index_copy_(1, slots, src)
