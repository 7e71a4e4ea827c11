"""Operating the cache through `StorageManager.operations` (kvstore/tier_operations.py): tiers by
name, the data path's guards, capabilities found by type, chunks only, and evictions explained
only where this process sees them all. Real tiers: cpu, disk, a redis-server process, and a
cache-server address nobody listens on."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.redis import RedisServer, free_port
from kvkeys.stored_keys import usage_group
from kvstore.backends.disk import DiskBackend
from kvstore.backends.memory import CPUBackend
from kvstore.budget import BudgetError
from kvstore.pin_set import PinError
from kvstore.registry import create_backend
from kvstore.storage_manager import StorageManager
from kvstore.store_config import KVStoreConfig, TierSpec
from tests.fixtures.tiers import chunk, ckey

BOOKKEEPING = "kvtier:index:families"  # connector/key_families.py's index: a tier's own value


def _chunk_bytes() -> int:
    return chunk(0).nbytes


def test_a_tier_backing_off_is_not_called_and_the_operation_says_why(tmp_path: Path) -> None:
    urls = ["cpu", f"disk://{tmp_path}", f"kvtier://127.0.0.1:{free_port()}"]  # nobody listens on the last
    manager = StorageManager.from_config(KVStoreConfig(tiers=[TierSpec.from_url(u, "tier") for u in urls]))
    ops = manager.operations
    cpu, disk, down = manager.names
    try:
        manager.batched_put([(ckey(0), chunk(0))])
        manager.flush()
        skipped = manager.stats()[down].skipped
        with pytest.raises(PinError, match="kvtier.*backing off"):
            ops.pin("kvtier", [ckey(0)])
        assert manager.stats()[down].skipped == skipped + 1  # the guard refused it: no call reached the tier
        removed, errors = ops.delete_prefix("kvtier:test:")
        assert removed == {cpu: 1, disk: 1} and "backing off" in errors[down]
        assert ops.describe([ckey(0)])[down] == [None]  # a read answers "nothing", as a lookup does
    finally:
        manager.close()


def test_what_a_tier_cannot_do_names_the_tiers_that_can(tmp_path: Path, redis_server: RedisServer) -> None:
    redis = create_backend(TierSpec(redis_server.url))
    manager = StorageManager([CPUBackend(), redis], names=["0:cpu", "1:redis"])
    ops = manager.operations
    try:
        manager.batched_put([(ckey(0), chunk(0))])
        manager.flush()
        with pytest.raises(PinError, match="1:redis cannot pin chunks; here 0:cpu can"):
            ops.pin("redis", [ckey(0)])
        with pytest.raises(BudgetError, match="maxmemory"):
            ops.set_budget("redis", byte_budget=1 << 20)
        usage = ops.usage()
        assert usage["1:redis"] is None and usage["0:cpu"] == {usage_group(ckey(0)): (1, _chunk_bytes())}
        removed, errors = ops.delete_idle(0.0)
        assert removed == {"0:cpu": 1}
        assert errors == {"1:redis": "tier 1:redis cannot tell when its chunks were last used"}
        assert ops.delete_prefix("kvtier:test:") == ({"0:cpu": 0, "1:redis": 1}, {})
    finally:
        manager.close()


def test_operations_touch_chunks_only(tmp_path: Path) -> None:
    manager = StorageManager([CPUBackend(), DiskBackend(tmp_path)], names=["0:cpu", "1:disk"])
    ops = manager.operations
    try:
        assert manager.tier_put("1:disk", BOOKKEEPING, chunk(1))
        for op in (lambda: ops.pin("disk", [BOOKKEEPING]), lambda: ops.unpin("disk", [BOOKKEEPING]),
                   lambda: ops.delete("disk", [BOOKKEEPING]), lambda: ops.copy("disk", "cpu", [BOOKKEEPING])):
            with pytest.raises(ValueError, match="bookkeeping"):
                op()
        assert ops.delete_idle(0.0) == ({"0:cpu": 0, "1:disk": 0}, {})
        assert manager.tier_get("1:disk", BOOKKEEPING) is not None  # untouched by every operation above
    finally:
        manager.close()


def test_evictions_are_explained_only_where_this_process_sees_them_all(tmp_path: Path) -> None:
    cpu = CPUBackend(byte_budget=2 * _chunk_bytes())
    disk = DiskBackend(tmp_path, byte_budget=2 * _chunk_bytes() + 4096)
    manager = StorageManager([cpu, disk], names=["0:cpu", "1:disk"])
    try:
        for i in range(3):
            manager.batched_put([(ckey(i), chunk(i))])
        manager.flush()
        assert not cpu.contains(ckey(0)) and not disk.contains(ckey(0))  # both evicted the oldest
        evicted = manager.operations.evicted([ckey(0), ckey(1), ckey(7)])
        assert evicted == {"0:cpu": [True, False, False], "1:disk": None}  # another process may share the disk
        manager.batched_put([(ckey(0), chunk(0))])  # stored again: no longer "evicted"
        assert manager.operations.evicted([ckey(0)])["0:cpu"] == [False]
    finally:
        manager.close()
