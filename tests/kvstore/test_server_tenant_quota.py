"""The cache server's per-tenant quota (`kvtier cache-server --tenant-quota`, issue #30 step 3):
no tenant holds more than the quota in memory nor on the disk spill, a tenant at its quota
evicts its own least recently used entries, and another tenant's entries are never evicted
for it. Checked in the store against an LRU oracle after every operation, and against a real
server process by what it holds (EXISTS) and the spill files it wrote."""

from __future__ import annotations

import os
import random
from collections import OrderedDict

import pytest

from harness.cache_server import CacheServerProcess
from kvkeys.tenants import key_tenant_bytes, tenant_prefix
from kvstore.backends.server_client import CacheServerClient
from kvstore.cache_server import spillfile as F
from kvstore.cache_server.store import ByteStore
from tests.fixtures.cache_server import live_dir, settled

TAGS = ("a1" * 8, "b2" * 8, "c3" * 8)
KIB = 1 << 10


def _key(tag: str | None, i: int) -> bytes:
    return (f"kvtier:m:{i}" if tag is None else f"{tenant_prefix(tag)}m:{i}").encode()


def test_random_workload_keeps_every_tenant_within_its_quota_by_its_own_lru() -> None:
    quota = 40 * KIB
    store = ByteStore(1 << 30, tenant_quota=quota)
    rng = random.Random(30)
    model: dict[str | None, OrderedDict[bytes, int]] = {t: OrderedDict() for t in (*TAGS, None)}
    for i in range(400):
        tenant = rng.choice((*TAGS, TAGS[0], None))
        entries = model[tenant]
        if entries and rng.random() < 0.3:  # a read: its tenant's most recent entry now
            key = rng.choice(list(entries))
            assert store.get(key) is not None
            entries.move_to_end(key)
            continue
        key = _key(tenant, rng.randrange(60))
        value = os.urandom(rng.randint(1, 12) * KIB)
        assert store.put(key, value)
        entries[key] = len(key) + len(value)
        entries.move_to_end(key)
        while tenant is not None and sum(entries.values()) > quota:
            entries.popitem(last=False)
        for t, expected in model.items():
            held = {k for k in (_key(t, j) for j in range(60)) if store.contains(k)}
            assert held == set(expected), f"op {i}: tenant {t} holds {sorted(held ^ set(expected))} wrongly"
        assert all(n <= quota for n in store.tenant_bytes().values())
        assert store.tenant_bytes() == {t: sum(model[t].values()) for t in TAGS if model[t]}
    assert all(sum(model[t].values()) > quota // 2 for t in TAGS)
    assert store.stats().tenant_evictions > 0


def test_an_entry_larger_than_the_quota_is_refused_and_evicts_nothing() -> None:
    store = ByteStore(1 << 20, tenant_quota=10 * KIB)
    assert store.put(_key(TAGS[0], 0), b"x" * (6 * KIB))
    assert not store.put(_key(TAGS[0], 1), b"x" * (11 * KIB))
    assert store.contains(_key(TAGS[0], 0)) and store.stats().rejected == 1
    assert store.put(_key(None, 0), b"x" * (100 * KIB))  # unsalted: only the memory budget applies
    assert key_tenant_bytes(_key(TAGS[0], 0)) == TAGS[0] and key_tenant_bytes(b"kvtier:tenant-\xff") is None


def test_a_quota_below_a_tenants_pinned_entries_is_refused_and_a_pin_outlives_a_lower_one() -> None:
    store = ByteStore(1 << 20)
    pinned, other = _key(TAGS[0], 0), _key(TAGS[0], 1)
    assert store.put(pinned, b"x" * (6 * KIB)) and store.put(other, b"x" * (6 * KIB))
    assert store.pin_keys([pinned]) > 0
    with pytest.raises(ValueError, match="pinned"):
        store.set_limits(tenant_quota=4 * KIB)  # the pinned entry alone is over it: nothing changes
    assert store.tenants.quota is None and store.contains(pinned) and store.contains(other)
    store.set_limits(tenant_quota=8 * KIB)  # the unpinned entry goes, the pinned one stays (no spill)
    assert store.contains(pinned) and not store.contains(other) and store.tenants.quota == 8 * KIB


def _files_per_tenant(root) -> dict[str | None, int]:
    held: dict[str | None, int] = {}
    for entry in F.scan(live_dir(root)):
        tag = key_tenant_bytes(entry.key)
        held[tag] = held.get(tag, 0) + entry.size
    return held


def test_a_flood_against_a_real_server_stays_within_the_quota_in_memory_and_on_disk(
        cache_server_factory: type[CacheServerProcess], tmp_path) -> None:
    quota = 1 << 20
    server = cache_server_factory("--max-bytes", "3MiB", "--disk", str(tmp_path), "--max-disk-bytes", "16MiB",
                                  "--tenant-quota", str(quota))
    c = CacheServerClient("127.0.0.1", server.port)
    value_len = 200 * KIB
    victim = [_key(TAGS[1], i) for i in range(4)]
    unsalted = _key(None, 0)
    assert all(c.put_many([(k, os.urandom(value_len)) for k in [*victim, unsalted]]))
    flood = [_key(TAGS[0], i) for i in range(40)]
    for i, key in enumerate(flood):
        assert c.put(key, os.urandom(value_len))
        if i % 4 == 3:
            assert c.get(flood[i - 3]) is not None or not c.exists(flood[i - 3])  # reads promote from disk
        settled(c)
        on_disk = {e.key for e in F.scan(live_dir(tmp_path))}
        present = {k for k, ok in zip(flood, c.exists_many(flood)) if ok}
        in_memory = present - on_disk
        assert sum(len(k) + value_len for k in in_memory) <= quota, f"put {i}: memory over the quota"
        assert _files_per_tenant(tmp_path).get(TAGS[0], 0) <= quota, f"put {i}: disk over the quota"
        assert all(c.exists_many([*victim, unsalted])), f"put {i}: the flood evicted another tenant's entry"
    stats = c.stats()
    assert stats["tenant_quota"] == quota and stats["tenant_evictions"] > 0
    assert not c.exists(flood[0]) and c.exists(flood[-1])  # its own oldest went
    c.close()


def test_a_restart_with_a_smaller_quota_evicts_the_tenants_oldest_files(
        cache_server_factory: type[CacheServerProcess], tmp_path) -> None:
    server = cache_server_factory("--max-bytes", "1MiB", "--disk", str(tmp_path), "--max-disk-bytes", "16MiB")
    c = CacheServerClient("127.0.0.1", server.port)
    keys = [_key(TAGS[2], i) for i in range(12)]
    for key in keys:
        assert c.put(key, os.urandom(200 * KIB))
    settled(c)
    c.close()
    assert server.stop() == 0  # flushes memory to disk
    assert _files_per_tenant(tmp_path)[TAGS[2]] > 1 << 20
    again = cache_server_factory("--max-bytes", "1MiB", "--disk", str(tmp_path), "--max-disk-bytes", "16MiB",
                                 "--tenant-quota", "1MiB")
    c = CacheServerClient("127.0.0.1", again.port)
    held = [ok for ok in c.exists_many(keys)]
    assert 0 < sum(held) < len(keys) and held[-1]
    assert _files_per_tenant(tmp_path)[TAGS[2]] <= 1 << 20
    c.close()

