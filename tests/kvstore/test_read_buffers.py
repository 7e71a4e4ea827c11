"""Receive buffers are reused only once nothing views them: a decoded tensor keeps its buffer
out of the pool, and the pool keeps at most its byte bound of free buffers."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path

import numpy as np
import torch

from kvstore.read_buffers import PAGE, ReadBufferPool
from kvstore.registry import create_backend
from kvstore.store_config import TierSpec
from tests.fixtures.tiers import chunk, ckey


def _tensor(view: memoryview) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer(view[8:], dtype=torch.uint8)


def test_a_buffer_viewed_by_a_tensor_is_not_handed_out_again() -> None:
    pool = ReadBufferPool()
    first = pool.take(4096)
    first[:] = b"\x01" * 4096
    t = _tensor(first)
    del first
    gc.collect()
    second = pool.take(4096)  # must be other memory: t still views the first
    second[:] = b"\x02" * 4096
    assert pool.reused == 0 and bool((t == 1).all())
    del t, second
    third = pool.take(4096)
    assert pool.reused == 1 and len(third) == 4096


def test_sizes_fit_and_the_free_bound_holds() -> None:
    held = 4000 + PAGE  # a buffer holds a page more than it serves, to start a view on one
    pool = ReadBufferPool(max_free_bytes=2 * held + 100)
    views = [pool.take(4000) for _ in range(3)]
    del views
    assert pool.free_bytes == 2 * held  # the third did not fit under the bound
    assert len(pool.take(1000)) == 1000 and pool.reused == 0  # 4000 > 2 x 1000: not wasted on it
    assert len(pool.take(3000)) == 3000 and pool.reused == 1
    assert len(pool.take(0)) == 0


def test_views_start_on_a_page_boundary() -> None:
    # reads from the page cache into memory 16 bytes past a page ran at half speed
    pool = ReadBufferPool()
    views = [pool.take(n) for n in (1, 4000, 5000, 1 << 20)]
    assert all(np.frombuffer(v, dtype=np.uint8).ctypes.data % PAGE == 0 for v in views)
    del views
    again = pool.take(3000)  # a reused buffer too
    assert pool.reused == 1 and np.frombuffer(again, dtype=np.uint8).ctypes.data % PAGE == 0


def test_the_disk_tier_reuses_read_buffers_and_reads_right(tmp_path: Path) -> None:
    tier = create_backend(TierSpec(f"disk://{tmp_path}/d"))
    for i in range(3):
        tier.put(ckey(i), chunk(i))
    got = [tier.get(ckey(i)) for i in range(3)]  # all alive: three buffers
    assert all(g is not None and torch.equal(g, chunk(i)) for i, g in enumerate(got))
    del got
    for _ in range(2):
        for i in range(3):
            g = tier.get(ckey(i))
            assert g is not None and torch.equal(g, chunk(i))
    assert tier._read_buffers.reused >= 6  # type: ignore[attr-defined]
