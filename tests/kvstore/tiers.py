"""Helpers shared by the kvstore tier tests: building each tier kind on real parts."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvstore.backend import StorageBackend
from kvstore.config import TierSpec
from kvstore.registry import create_backend

TIER_KINDS = ["device", "cpu", "disk", "redis"]


def tier_spec(kind: str, tmp_path: Path, redis_url: str | None, **kw: object) -> TierSpec:
    url = {"device": "device", "cpu": "cpu", "disk": f"disk://{tmp_path}/disk", "redis": redis_url}[kind]
    return TierSpec(url=url, **kw)  # type: ignore[arg-type]


def make_tier(kind: str, tmp_path: Path, redis_url: str | None, **kw: object) -> StorageBackend:
    return create_backend(tier_spec(kind, tmp_path, redis_url, **kw))


def chunk(i: int, tokens: int = 16, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """A distinct small chunk per i: (layers=2, 2, tokens, heads=3, head_size=64)."""
    g = torch.Generator().manual_seed(i)
    return torch.randn(2, 2, tokens, 3, 64, generator=g).to(dtype)


def ckey(i: int) -> str:
    return f"kvtier:test:float16:v1:c16:{i:032x}"


def longest_calls_while_frozen(pid: int, calls: dict[str, Callable[[], object]], rounds: int = 2,
                               pause_s: float = 0.0) -> dict[str, float]:
    """Freezes process `pid` (SIGSTOP), runs every call `rounds` times (`pause_s` apart, so
    the tier's backoff may elapse and probe again), then resumes it (SIGCONT, even if a call
    raised); returns each call's longest duration in seconds."""
    took: dict[str, float] = {}
    os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(rounds):
            for name, call in calls.items():
                t0 = time.monotonic()
                call()
                took[name] = max(took.get(name, 0.0), time.monotonic() - t0)
            time.sleep(pause_s)
    finally:
        os.kill(pid, signal.SIGCONT)
    return took
