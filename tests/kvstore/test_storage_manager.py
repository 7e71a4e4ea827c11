"""The storage manager over real tiers: write-through, promotion, background writer, pins,
budgets under random workloads, failing tiers, and concurrent readers/writers."""

from __future__ import annotations

import logging
import os
import random
import shutil
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from kvstore.backend import leading_run
from kvstore.backends.disk import DiskBackend
from kvstore.backends.memory import CPUBackend
from kvstore.storage_manager import StorageManager
from kvstore.store_config import KVStoreConfig
from tests.fixtures.tiers import chunk, ckey, make_tier


def _chunk_bytes() -> int:
    return chunk(0).numel() * chunk(0).element_size()


def _dir_bytes(root: Path) -> int:
    """Bytes in chunk files right now (the background writer may remove one while we look)."""
    total = 0
    for p in root.glob("*.kvc"):
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total


def _read(mgr: StorageManager, key: str, read_only: bool = False) -> torch.Tensor | None:
    """The chunk under `key` from the fastest tier holding it (a read: promotes nothing)."""
    return mgr.fetch([key], read_only=read_only)[0][0]


def test_write_through_and_promotion(tmp_path: Path) -> None:
    cpu, disk = CPUBackend(byte_budget=10 * _chunk_bytes()), DiskBackend(tmp_path, codec="lz4")
    with StorageManager([cpu, disk], names=["cpu", "disk"]) as mgr:
        mgr.batched_put([(ckey(i), chunk(i)) for i in range(3)])
        assert leading_run(cpu.batched_contains([ckey(0), ckey(1), ckey(2)])) == 3  # fastest tier: synchronous
        assert mgr.flush(timeout=10)
        assert leading_run(disk.batched_contains([ckey(0), ckey(1), ckey(2)])) == 3
        cpu.clear()
        assert mgr.batched_contains([ckey(0), ckey(1), ckey(2), ckey(3)]) == [True, True, True, False]
        keys = [ckey(1), ckey(5), ckey(2)]
        found = mgr.fetch(keys)
        got = [kv for kv, _ in found]
        assert torch.equal(got[0], chunk(1)) and got[1] is None and torch.equal(got[2], chunk(2))
        assert [tier for _, tier in found] == [1, -1, 1]  # which tier served each
        assert not cpu.contains(ckey(1))  # reading promotes nothing ...
        mgr.promote([(k, kv, tier) for k, (kv, tier) in zip(keys, found) if kv is not None])
        assert cpu.contains(ckey(1)) and cpu.contains(ckey(2)) and not cpu.contains(ckey(0))  # ... promote does
        assert torch.equal(_read(mgr, ckey(1)), chunk(1))
        s = mgr.stats()
        assert (s["disk"].hits, s["cpu"].hits) == (2, 1)
        assert s["disk"].bytes_loaded == 2 * _chunk_bytes() and s["disk"].load_seconds > 0
        assert s["cpu"].bytes_stored >= 3 * _chunk_bytes()
        assert mgr.holds.total() == 0


def test_read_only_gets_and_owned_puts_skip_copies_but_keep_the_tier_intact(tmp_path: Path) -> None:
    cpu, disk = CPUBackend(byte_budget=4 * _chunk_bytes()), DiskBackend(tmp_path)
    with StorageManager([cpu, disk], names=["cpu", "disk"]) as mgr:
        owned, caller_kept = chunk(1), chunk(2)
        mgr.batched_put([(ckey(1), owned)], owned=True)
        mgr.batched_put([(ckey(2), caller_kept)])
        caller_kept.zero_()  # not handed over: the tier holds its own copy
        assert torch.equal(_read(mgr, ckey(2)), chunk(2))
        # A read-only fetch hands out the tier's tensor itself; a plain fetch a private copy.
        ro = _read(mgr, ckey(1), read_only=True)
        assert ro is not None and ro.data_ptr() == owned.data_ptr()
        mine = _read(mgr, ckey(1))
        assert mine is not None and mine.data_ptr() != owned.data_ptr()
        mine.add_(1)
        assert torch.equal(_read(mgr, ckey(1)), chunk(1))
        # A view of a larger tensor is copied even when handed over: keeping it would keep
        # bytes the budget does not see.
        big = torch.cat([chunk(3), chunk(4)], dim=2)
        mgr.batched_put([(ckey(3), big[:, :, : chunk(3).shape[2]])], owned=True)
        assert cpu.batched_get([ckey(3)], read_only=True)[0].data_ptr() != big.data_ptr()
        assert cpu.stats().bytes_used == 3 * _chunk_bytes()
        # Promotion of a read-only hit keeps the decoded tensor in the faster tier as it is.
        assert mgr.flush(timeout=10)
        cpu.clear()
        [(got, tier)] = mgr.fetch([ckey(1)], read_only=True)
        mgr.promote([(ckey(1), got, tier)])
        assert torch.equal(got, chunk(1)) and cpu.batched_get([ckey(1)], read_only=True)[0].data_ptr() == got.data_ptr()
        cpu.clear()
        [(got, tier)] = mgr.fetch([ckey(1)])  # the caller's own: promoted, the tier keeps a copy
        mgr.promote([(ckey(1), got, tier)], owned=False)
        assert cpu.batched_get([ckey(1)], read_only=True)[0].data_ptr() != got.data_ptr()
        assert mgr.holds.total() == 0


def test_slow_tier_writes_run_at_lower_priority(tmp_path: Path) -> None:
    """Serving threads win the CPU over background writes to slow tiers."""
    seen: list[int] = []

    class _Recording(DiskBackend):
        def batched_put(self, items, *, owned: bool = False) -> list[bool]:
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            return super().batched_put(items, owned=owned)

    with StorageManager([CPUBackend(), _Recording(tmp_path)]) as mgr:
        mgr.batched_put([(ckey(0), chunk(0))])
        assert mgr.flush(timeout=10)
    assert seen == [min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)]


def test_existence_combines_tiers(tmp_path: Path) -> None:
    cpu, disk = CPUBackend(), DiskBackend(tmp_path)
    with StorageManager([cpu, disk]) as mgr:
        disk.batched_put([(ckey(i), chunk(i)) for i in range(3)])
        cpu.put(ckey(3), chunk(3))  # chunk 3 only in the fast tier, 0-2 only in the slow one
        assert mgr.batched_contains([ckey(i) for i in range(5)]) == [True] * 4 + [False]
        assert mgr.tier_prefix_hits([ckey(i) for i in range(5)]) == {"0:cpu": 0, "1:disk": 3}
        assert mgr.batched_contains([ckey(4), ckey(1), ckey(3), ckey(9)]) == [False, True, True, False]


def test_load_holds_protect_and_never_go_negative(tmp_path: Path) -> None:
    cpu = CPUBackend(byte_budget=2 * _chunk_bytes())
    with StorageManager([cpu]) as mgr:
        mgr.batched_put([(ckey(0), chunk(0))])
        mgr.hold([ckey(0)])
        mgr.batched_put([(ckey(1), chunk(1))])
        mgr.batched_put([(ckey(2), chunk(2))])  # evicts 1, not the held 0
        assert _read(mgr, ckey(0)) is not None and _read(mgr, ckey(1)) is None
        mgr.release([ckey(0)])
        with pytest.raises(ValueError, match="not held"):
            mgr.release([ckey(0)])
        mgr.hold([ckey(5)])
        with pytest.raises(ValueError, match="not held"):
            mgr.release([ckey(5), ckey(5)])  # all-or-nothing: the single hold stays
        assert mgr.holds.count(ckey(5)) == 1
        mgr.release([ckey(5)])
        assert mgr.holds.total() == 0


def test_copy_between_tiers_stops_at_a_gap_and_delete_from_one_tier_beats_a_pin(tmp_path: Path) -> None:
    cpu, disk = CPUBackend(byte_budget=10 * _chunk_bytes()), DiskBackend(tmp_path, codec="lz4")
    with StorageManager([cpu, disk], names=["cpu", "disk"]) as mgr:
        mgr.batched_put([(ckey(i), chunk(i)) for i in (0, 1, 3)])
        assert mgr.flush(timeout=10)
        for i in (0, 1, 3):
            assert cpu.delete(ckey(i))
        ops = mgr.operations
        assert ops.copy("disk", "cpu", [ckey(i) for i in range(4)]) == 2  # ckey(2) is a gap: 3 is not copied
        assert leading_run(cpu.batched_contains([ckey(i) for i in range(4)])) == 2 and not cpu.contains(ckey(3))
        assert torch.equal(cpu.get(ckey(1)), chunk(1)) and ops.copy("cpu", "cpu", [ckey(0)]) == 0
        assert not mgr.holds.is_held(ckey(0))  # the copy's load holds are released

        assert ops.pin("cpu", [ckey(0)]) > 0
        assert ops.delete("cpu", [ckey(0), ckey(2)]) == 1  # pinned, removed all the same
        assert not cpu.contains(ckey(0)) and disk.contains(ckey(0)) and cpu.stats().pinned_entries == 0


def test_bad_input_is_a_value_error_and_stores_nothing(tmp_path: Path) -> None:
    with StorageManager([CPUBackend()]) as mgr:
        with pytest.raises(ValueError, match="torch.Tensor"):
            mgr.batched_put([(ckey(0), [1, 2, 3])])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="layers, 2, tokens"):
            mgr.batched_put([(ckey(1), chunk(1)), (ckey(2), torch.zeros(3, 4))])
        with pytest.raises(ValueError, match="key"):
            mgr.batched_put([("", chunk(0))])
        assert mgr.batched_contains([ckey(1)]) == [False]
    with pytest.raises(ValueError, match="tiers"):
        StorageManager([])


class GatedDisk(DiskBackend):
    """A real disk tier whose writes wait on a gate, to fill the background queue."""

    def __init__(self, root: Path, gate: threading.Event) -> None:
        super().__init__(root)
        self.gate = gate
        self.entered = threading.Event()

    def _batched_put_bytes(self, items) -> list[bool]:
        self.entered.set()
        self.gate.wait(10)
        return super()._batched_put_bytes(items)


@pytest.mark.parametrize("drop", ["drop_oldest", "drop_new"])
def test_full_queue_drops_and_never_blocks(tmp_path: Path, drop: str) -> None:
    gate = threading.Event()
    disk = GatedDisk(tmp_path, gate)
    with StorageManager([CPUBackend(), disk], names=["cpu", "disk"], queue_size=2, queue_full=drop) as mgr:
        mgr.batched_put([(ckey(0), chunk(0))])
        assert disk.entered.wait(10)  # the worker is now stuck inside the first write
        for i in range(1, 6):  # two queue, three are dropped
            mgr.batched_put([(ckey(i), chunk(i))])
        assert _read(mgr, ckey(5)) is not None  # serving goes on while the slow tier is stuck
        gate.set()
        assert mgr.flush(timeout=10)
        assert mgr.writer_stats()["dropped"] == 3 and mgr.stats()["disk"].dropped_writes == 3
        on_disk = [disk.contains(ckey(i)) for i in range(6)]
        assert sum(on_disk) == 3 and on_disk[0]
        assert on_disk[4:] == ([True, True] if drop == "drop_oldest" else [False, False])


def test_failing_tier_is_skipped_with_backoff_and_recovers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.kvstore")
    root = tmp_path / "d"
    disk = DiskBackend(root)
    cpu = CPUBackend()
    mgr = StorageManager([disk, cpu], names=["disk", "cpu"], backoff_initial_s=0.05, backoff_max_s=0.1)
    shutil.rmtree(root)
    root.write_bytes(b"")  # the disk tier now fails every write
    for i in range(20):
        mgr.batched_put([(ckey(i), chunk(i))])  # never raises
    assert mgr.flush(timeout=10)
    s = mgr.stats()
    assert not s["disk"].healthy and s["disk"].errors >= 1 and s["disk"].skipped >= 1
    assert s["disk"].last_error.startswith("BackendError")
    assert torch.equal(_read(mgr, ckey(7)), chunk(7))  # served from the healthy tier
    root.unlink()
    root.mkdir()
    time.sleep(0.15)
    mgr.batched_put([(ckey(50), chunk(50))])  # the write probe: writes recover
    assert mgr.stats()["disk"].write_healthy and disk.contains(ckey(50))
    assert torch.equal(_read(mgr, ckey(50)), chunk(50))  # the read probe: reads recover
    assert mgr.stats()["disk"].healthy
    messages = [r.getMessage() for r in caplog.records]
    assert sum("disk: writes failing" in m for m in messages) == 1
    assert sum("disk: writes recovered" in m for m in messages) == 1
    mgr.close()


def test_budgets_never_exceeded_under_random_workload(tmp_path: Path) -> None:
    budgets = [3 * _chunk_bytes(), 7 * _chunk_bytes()]
    cfg = KVStoreConfig.from_dict({"tiers": [
        {"url": "cpu", "budget": budgets[0]},
        {"url": f"disk://{tmp_path}", "budget": budgets[1]},
    ], "queue_size": 4})
    rng = random.Random(7)
    with StorageManager.from_config(cfg) as mgr:
        for _ in range(150):
            r = rng.random()
            keys = [ckey(rng.randrange(25)) for _ in range(rng.randint(1, 3))]
            if r < 0.5:
                mgr.batched_put([(k, chunk(int(k[-8:], 16))) for k in keys])
            elif r < 0.8:
                for k, (kv, _) in zip(keys, mgr.fetch(keys)):
                    assert kv is None or torch.equal(kv, chunk(int(k[-8:], 16)))
            elif r < 0.9:
                mgr.hold(keys)
                mgr.batched_contains(keys)
                mgr.release(keys)
            else:
                mgr.delete(keys[0])
            for (name, s), budget in zip(mgr.stats().items(), budgets):
                assert s.backend.bytes_used <= budget, name
            assert _dir_bytes(tmp_path) <= budgets[1]
        mgr.flush()
        assert mgr.holds.total() == 0
        assert sum(s.backend.evictions for s in mgr.stats().values()) > 0


@pytest.mark.parametrize("kind", ["cpu", "disk", "redis", "manager"])
def test_concurrent_threads_never_see_a_torn_value(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """8 threads put and get the same keys; every value read is one thread's whole write."""
    redis_url = request.getfixturevalue("redis_server").url if kind in ("redis", "manager") else None
    if kind == "manager":
        store = StorageManager([CPUBackend(byte_budget=4 * 2 * 2 * 64 * 3 * 64 * 4),
                                DiskBackend(tmp_path, codec="lz4"),
                                make_tier("redis", tmp_path, redis_url)], queue_size=8)
        read = partial(_read, store)
    else:
        store = make_tier(kind, tmp_path, redis_url)
        read = store.get
    keys = [ckey(i) for i in range(4)]
    errors: list[str] = []

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        for n in range(40):
            key = rng.choice(keys)
            if rng.random() < 0.5:
                # every element of a write carries its writer and sequence: a mix would show
                store.batched_put([(key, torch.full((2, 2, 64, 3, 64), float(tid * 1000 + n)))])
            else:
                kv = read(key)
                if kv is not None and not bool((kv == kv.flatten()[0]).all()):
                    errors.append(f"torn value under {key}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if kind == "manager":
        store.flush()
        assert store.holds.total() == 0
    assert errors == []
    store.close()
