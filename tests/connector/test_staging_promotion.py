"""One staging copy and background promotion: a stored chunk is gathered once and that one
buffer feeds every tier's write; a chunk loaded from a slower tier is promoted to the faster
ones by the store queue after the load, never on the load's path."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from connector.engine_connector import build_connector
from connector.key_families import INDEX_KEY
from kvstore.backends.disk import DiskBackend
from kvstore.backends.memory import CPUBackend
from kvstore.storage_manager import StorageManager
from tests.fixtures.connector import CHUNK, assert_idle, engine, run


class _RecordingDisk(DiskBackend):
    """A real disk tier that records the address of every chunk handed to it for writing."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.seen: dict[str, int] = {}

    def batched_put(self, items, *, owned=False):
        self.seen.update({k: kv.data_ptr() for k, kv in items})
        return super().batched_put(items, owned=owned)


@pytest.mark.slow
@pytest.mark.parametrize("layerwise", [False, True])
def test_every_tier_writes_from_the_one_gathered_buffer(layerwise, default_model_path, prompt_ids, tmp_path):
    fast, disk = CPUBackend(), _RecordingDisk(tmp_path / "kv")
    conn = build_connector(None, storage=StorageManager([fast, disk]), chunk_size=CHUNK, use_layerwise=layerwise)
    with engine(default_model_path, conn, enable_prefix_caching=False) as llm:
        run(llm, prompt_ids)
        assert conn.flush(timeout=60)
        stored = dict(fast._store)
        assert stored and set(disk.seen) - {INDEX_KEY} == set(stored)  # the key families index aside
        # The cpu tier kept the gathered tensor itself and the disk tier wrote from that same memory.
        assert all(disk.seen[k] == kv.data_ptr() for k, kv in stored.items())
        assert conn.storage.staging_copies == 0  # a CPU engine's gather is already on the host
        assert_idle(llm, conn)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="staging from a GPU needs CUDA")
def test_a_gpu_chunk_is_staged_to_host_once_for_every_host_tier(tmp_path):
    fast, disk = CPUBackend(), _RecordingDisk(tmp_path / "kv")
    with StorageManager([fast, disk]) as sm:
        kv = torch.randn(2, 2, 16, 2, 8, device="cuda")
        sm.batched_put([("k", kv)], owned=True)
        assert sm.flush(timeout=30)
        assert sm.staging_copies == 1
        assert fast._store["k"].device.type == "cpu" and disk.seen["k"] == fast._store["k"].data_ptr()
        assert torch.equal(sm.fetch(["k"])[0][0], kv.cpu())


@pytest.mark.slow
def test_a_slow_tier_hit_is_promoted_by_the_store_queue_after_the_load(default_model_path, prompt_ids, reference,
                                                                      tmp_path):
    fast, disk = CPUBackend(), DiskBackend(tmp_path / "kv")
    conn = build_connector(None, storage=StorageManager([fast, disk]), chunk_size=CHUNK)
    with engine(default_model_path, conn, enable_prefix_caching=False) as llm:
        run(llm, prompt_ids)
        assert conn.flush(timeout=60)
        keys = [sp.key for sp in conn.planner.keyspace.spans(prompt_ids)]
        fast.clear()  # only the disk tier holds the prefix now
        gate = threading.Event()
        conn.worker.stores._writer.submit(lambda: gate.wait(60))  # the store queue is busy meanwhile
        try:
            warm = run(llm, prompt_ids)
            # Loaded from disk and answered while the promotion still waits in the store queue.
            assert warm.outputs[0].token_ids == reference and warm.num_cached_tokens == len(prompt_ids) - 1
            by_tier = conn.request_metrics(warm.request_id).loaded_tokens_by_tier
            assert by_tier == {conn.storage.names[1]: len(prompt_ids) - 1}
            assert not any(fast.contains(k) for k in keys) and conn.worker.stores.promotions == 0
            assert conn.pending_stores() == len(keys)
        finally:
            gate.set()
        assert conn.flush(timeout=60)
        assert all(fast.contains(k) for k in keys) and conn.worker.stores.promotions == len(keys)
        again = run(llm, prompt_ids)  # now served by the cpu tier
        assert again.outputs[0].token_ids == reference
        by_tier = conn.request_metrics(again.request_id).loaded_tokens_by_tier
        assert by_tier == {conn.storage.names[0]: len(prompt_ids) - 1}
        assert conn.tier_metrics()[0].tokens_hit > 0
        assert_idle(llm, conn)


def test_fetch_names_the_tier_and_promote_fills_only_the_faster_tiers(tmp_path):
    fast, middle, slow = CPUBackend(), CPUBackend(), DiskBackend(tmp_path / "kv")
    with StorageManager([fast, middle, slow]) as sm:
        kv = torch.randn(2, 2, 4, 2, 8)
        slow.put("k", kv)
        [(got, tier)] = sm.fetch(["k"], read_only=True)
        assert tier == 2 and torch.equal(got, kv)
        assert not fast.contains("k") and not middle.contains("k")  # fetching promotes nothing
        assert sm.fetch(["absent"]) == [(None, -1)]
        sm.promote([("k", got, tier)])
        assert sm.flush(timeout=30)
        assert fast.contains("k") and middle.contains("k") and sm.fetch(["k"])[0][1] == 0
