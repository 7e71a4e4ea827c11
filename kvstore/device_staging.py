"""Staging chunks onto the devices the tiers keep them on: one copy per device, shared by
every tier there (pinned host memory from a GPU, copied without blocking and synchronised
once per batch, so the copies of one batch overlap)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

Items = list[tuple[str, torch.Tensor]]


def on_device(actual: torch.device, wanted: torch.device) -> bool:
    """Whether a tensor on `actual` is on `wanted` ("cuda" means the current CUDA device)."""
    if actual.type != wanted.type:
        return False
    if wanted.index is None and actual.type == "cuda":
        return actual.index == torch.cuda.current_device()
    return wanted.index is None or actual.index == wanted.index


def stage(items: Items, devices: Iterable[torch.device]) -> tuple[dict[torch.device, Items], int]:
    """Returns (`items` on each of `devices`: as they are where they already live, else one
    copy each; how many copies were made). The copies are complete when this returns."""
    out: dict[torch.device, Items] = {}
    streams: list[Any] = []
    made = 0
    for device in devices:
        if all(on_device(kv.device, device) for _, kv in items):
            out[device] = items
            continue
        pin = device.type == "cpu" and torch.cuda.is_available()
        copies = []
        for key, kv in items:
            if on_device(kv.device, device):
                copies.append((key, kv))
                continue
            dst = torch.empty(kv.shape, dtype=kv.dtype, device=device, pin_memory=pin)
            dst.copy_(kv, non_blocking=True)
            copies.append((key, dst))
            if kv.device.type == "cuda":
                streams.append(torch.cuda.current_stream(kv.device))
            made += 1
        out[device] = copies
    for stream in set(streams):
        stream.synchronize()  # the copies are complete before any tier reads them
    return out, made
