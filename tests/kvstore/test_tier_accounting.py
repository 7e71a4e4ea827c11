"""Metrics count what a tier accepted, not what it was offered; an unreachable tier at start-up
is one warning naming it, and the manager still answers (misses) without raising."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from harness.redis import free_port
from kvstore.storage_manager import StorageManager
from kvstore.store_config import KVStoreConfig, TierSpec


def _chunk(tokens: int = 8) -> torch.Tensor:
    return torch.randn(2, 2, tokens, 2, 8)


def _nbytes(kv: torch.Tensor) -> int:
    return kv.numel() * kv.element_size()


@pytest.mark.parametrize("url", ["cpu", "disk"])
def test_bytes_stored_counts_only_accepted_chunks(tmp_path: Path, url: str) -> None:
    small, big = _chunk(2), _chunk(64)
    tier_url = f"disk://{tmp_path}/kv" if url == "disk" else url
    # room for the small chunk (plus the disk tier's framing), never for the big one
    budget = _nbytes(small) + 4096
    cfg = KVStoreConfig(tiers=[TierSpec(tier_url, budget=budget)])
    with StorageManager.from_config(cfg) as sm:
        sm.batched_put([("small", small), ("big", big)])
        stats = sm.stats()[f"0:{tier_url}"]
        assert stats.bytes_stored == _nbytes(small)
        assert stats.backend.rejected == 1 and stats.backend.puts == 1
        assert sm.batched_contains(["small", "big"]) == [True, False]


def test_slow_tier_counts_only_accepted_chunks(tmp_path: Path) -> None:
    kv = _chunk(64)
    cfg = KVStoreConfig(tiers=[TierSpec("cpu"), TierSpec(f"disk://{tmp_path}/kv", budget=100)])
    with StorageManager.from_config(cfg) as sm:
        sm.batched_put([("k", kv)])
        assert sm.flush(5.0)
        stats = sm.stats()
        assert stats["0:cpu"].bytes_stored == _nbytes(kv)
        assert stats[f"1:disk://{tmp_path}/kv"].bytes_stored == 0


@pytest.mark.parametrize("scheme", ["redis", "kvtier"])
def test_unreachable_tier_is_one_warning_and_a_miss(caplog: pytest.LogCaptureFixture, scheme: str) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.kvstore")
    url = f"{scheme}://127.0.0.1:{free_port()}" + ("/0" if scheme == "redis" else "")  # nothing listens there
    cfg = KVStoreConfig(tiers=[TierSpec("cpu"), TierSpec(url, options={"connect_timeout_s": 0.5})],
                        backoff_initial_s=0.01, backoff_max_s=0.02)
    with StorageManager.from_config(cfg) as sm:
        for i in range(5):  # requests after start-up: no further warnings
            sm.batched_put([(f"k{i}", _chunk(2))])
            assert sm.fetch([f"k{i}", "absent"])[1] == (None, -1)
            sm.flush(5.0)
        assert sm.stats()[f"1:{url}"].bytes_stored == 0
        assert sm.stats()[f"1:{url}"].healthy is False
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert url in warnings[0] and "unreachable" in warnings[0]
