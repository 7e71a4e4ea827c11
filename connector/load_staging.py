"""Host staging for loads: what a fetched chunk is copied from onto the engine's device.

On CUDA a copy from pageable host memory blocks the calling thread and cannot overlap with
compute; from pinned memory it is a true `non_blocking` copy on the loader's side stream. So
a fetched chunk (a decoded view of the received bytes, or a tier's own tensor) goes through
one pinned host buffer there; on a CPU engine it is scattered from where it is, no copy.
"""

from __future__ import annotations

import torch


def to_device_source(kv: torch.Tensor, device: torch.device, keep: list[torch.Tensor]) -> torch.Tensor:
    """Returns what to copy `kv` to `device` from without blocking: `kv` itself when it is
    already there, pinned, or the device is the CPU; else one pinned copy, appended to `keep`
    (the caller holds it until its stream has finished the copy)."""
    if device.type != "cuda" or kv.device.type != "cpu" or kv.is_pinned():
        return kv
    pinned = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
    pinned.copy_(kv)
    keep.append(pinned)
    return pinned
