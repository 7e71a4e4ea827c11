"""Per-tenant byte quotas (issue #30 step 3) on the exact tiers: cpu, disk and a real Redis.

A random multi-tenant workload (three salted tenants and unsalted keys, puts of random sizes and
reads that refresh the LRU order) is checked after every put against an independent measure of
what the tier holds (the tensors for cpu, the files for disk, STRLEN in Redis): no tenant ever
holds more than its quota, every put is stored, and which of a tenant's entries survive is
exactly its own LRU (so another tenant's entries are never evicted)."""

from __future__ import annotations

import os
import random
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from harness.redis import RedisServer
from kvkeys.tenants import key_tenant, tenant_prefix
from kvstore.backend import StorageBackend
from kvstore.backends.disk import DiskBackend
from kvstore.backends.disk.file_names import key_path, keys_with_prefix
from kvstore.budget import ByteBudget
from kvstore.budget_check import check_tier_budgets
from kvstore.registry import create_backend
from kvstore.store_config import KVStoreConfig, TierSpec

TAGS = ("a1" * 8, "b2" * 8, "c3" * 8)
QUOTA = 6 * 2 * 2 * 16 * 2 * 8 * 4  # six chunks of 16 tokens (float32)


def _chunk(tokens: int, fill: float) -> torch.Tensor:
    return torch.full((2, 2, tokens, 2, 8), fill)


def _key(tag: str | None, i: int) -> str:
    return f"kvtier:m:{i}" if tag is None else f"{tenant_prefix(tag)}m:{i}"


Sizer = Callable[[list[str]], list[int | None]]  # keys' bytes in the tier, measured outside it; None if absent
PUT_BYTES: dict[str, int] = {}  # the cpu tier (raw codec) keeps the tensor put: its bytes


def _put(tier: StorageBackend, key: str, kv: torch.Tensor) -> bool:
    PUT_BYTES[key] = kv.numel() * kv.element_size()
    return tier.put(key, kv)


def _tier(kind: str, tmp_path: Path, redis: RedisServer | None) -> tuple[StorageBackend, Sizer]:
    if kind == "cpu":
        tier = create_backend(TierSpec.from_url(f"cpu?tenant_quota={QUOTA}"))

        def cpu_size(keys: list[str]) -> list[int | None]:  # contains() does not touch the LRU order
            return [PUT_BYTES[k] if tier.contains(k) else None for k in keys]
        return tier, cpu_size
    if kind == "disk":
        root = tmp_path / "kv"
        tier = create_backend(TierSpec.from_url(f"disk://{root}?tenant_quota={QUOTA}"))

        def disk_size(keys: list[str]) -> list[int | None]:
            paths = [key_path(root, k) for k in keys]
            return [p.stat().st_size if p.exists() else None for p in paths]
        return tier, disk_size
    assert redis is not None
    tier = create_backend(TierSpec.from_url(f"{redis.url}?tenant_quota={QUOTA}"))
    client = redis.client()

    def redis_size(keys: list[str]) -> list[int | None]:
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.strlen(k)  # 0 for an absent key: a stored value is never empty
        return [int(n) or None for n in pipe.execute()]
    return tier, redis_size


@pytest.fixture(params=["cpu", "disk", "redis"])
def tier_and_sizer(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[StorageBackend, Sizer]]:
    redis = request.getfixturevalue("redis_server") if request.param == "redis" else None
    tier, sizer = _tier(request.param, tmp_path, redis)
    yield tier, sizer
    tier.close()


def test_random_workload_keeps_every_tenant_within_its_quota_by_its_own_lru(
        tier_and_sizer: tuple[StorageBackend, Sizer]) -> None:
    tier, size_of = tier_and_sizer
    rng = random.Random(30)
    # the oracle: per tenant, its keys in LRU order and their measured sizes
    model: dict[str | None, OrderedDict[str, int]] = {t: OrderedDict() for t in (*TAGS, None)}
    for i in range(240):
        tenant = rng.choice((*TAGS, TAGS[0], None))  # tenant a puts twice as often
        entries = model[tenant]
        if entries and rng.random() < 0.3:  # a read: the key becomes its tenant's most recent
            key = rng.choice(list(entries))
            assert tier.get(key) is not None
            entries.move_to_end(key)
            continue
        key = _key(tenant, rng.randrange(60))  # repeats: a put may replace a stored key
        assert _put(tier, key, _chunk(rng.randint(1, 16), float(i)))
        measured = size_of([key])[0]
        assert measured is not None, f"put {i}: {key} not stored"
        entries[key] = measured
        entries.move_to_end(key)
        while tenant is not None and sum(entries.values()) > QUOTA:
            entries.popitem(last=False)  # its own least recently used goes
        for t, expected in model.items():
            keys = [_key(t, j) for j in range(60)]
            sizes = dict(zip(keys, size_of(keys)))
            present = {k for k, n in sizes.items() if n is not None}
            assert present == set(expected), f"put {i}: tenant {t} holds {sorted(present ^ set(expected))} wrongly"
            held = sum(n or 0 for n in sizes.values())
            assert t is None or held <= QUOTA, f"put {i}: tenant {t} holds {held} > {QUOTA} bytes"
    assert all(sum(model[t].values()) > QUOTA // 2 for t in TAGS)  # the quotas were reached


def test_a_tenants_flood_evicts_none_of_anothers_entries(tier_and_sizer: tuple[StorageBackend, Sizer]) -> None:
    tier, size_of = tier_and_sizer
    victim = [_key(TAGS[1], i) for i in range(5)]
    for key in victim:
        assert _put(tier, key, _chunk(16, 1.0))
    unsalted = _key(None, 0)
    assert _put(tier, unsalted, _chunk(16, 2.0))
    for i in range(100):
        assert _put(tier, _key(TAGS[0], i), _chunk(16, 3.0))
        assert sum(n or 0 for n in size_of([_key(TAGS[0], j) for j in range(i + 1)])) <= QUOTA
    assert None not in size_of([*victim, unsalted])
    oldest, newest = size_of([_key(TAGS[0], 0), _key(TAGS[0], 99)])
    assert oldest is None and newest is not None  # the flood evicted its own oldest


def test_disk_quota_counts_every_processes_files(tmp_path: Path) -> None:
    """Two openers of one directory (as two processes): the quota bounds the tenant's files in
    the directory, whichever opener wrote them."""
    first, second = (DiskBackend(tmp_path, tenant_quota=QUOTA) for _ in range(2))
    tag = TAGS[2]
    for i in range(40):
        assert (first if i % 2 else second).put(_key(tag, i), _chunk(16, float(i)))
        files = keys_with_prefix(tmp_path, tenant_prefix(tag))
        assert sum(key_path(tmp_path, k).stat().st_size for k in files) <= QUOTA
    assert len(files) >= 5


def test_disk_quota_counts_live_writers_reservations(tmp_path: Path) -> None:
    """Another writer's temp file for the tenant (reserved under the directory's lock, not yet
    renamed) counts in the tenant's quota: a put that would exceed it with that is refused."""
    tier = DiskBackend(tmp_path, tenant_quota=QUOTA)
    tag = TAGS[0]
    chunk = _chunk(16, 1.0)
    assert tier.put(_key(tag, 0), chunk)
    one = key_path(tmp_path, _key(tag, 0)).stat().st_size
    (tmp_path / f".tmp-{os.getpid()}-{QUOTA - one // 2}-feed.{tag}").write_bytes(b"")  # a live writer's
    assert not tier.put(_key(tag, 1), chunk)
    assert tier.put(_key(TAGS[1], 1), chunk)  # another tenant's reservation is not this one's


def test_a_chunk_larger_than_the_quota_is_refused_and_evicts_nothing() -> None:
    budget = ByteBudget(None, tenant_quota=100)
    budget.add(_key(TAGS[0], 0), 60)
    assert budget.plan(_key(TAGS[0], 1), 101) is None
    assert budget.plan(_key(TAGS[0], 1), 60) == [_key(TAGS[0], 0)]
    assert budget.plan(_key(TAGS[1], 0), 100) == [] and budget.plan(_key(None, 0), 10**6) == []
    budget.is_pinned = lambda key: True  # only pinned entries of the tenant: cannot fit
    assert budget.plan(_key(TAGS[0], 1), 60) is None
    assert key_tenant(_key(TAGS[0], 0)) == TAGS[0]


@pytest.mark.parametrize("bad", ["lots", "-1"])
def test_tenant_quota_config_errors_name_the_key(bad: str) -> None:
    with pytest.raises(ValueError, match=r"tiers\[0\]\.tenant_quota"):
        KVStoreConfig.from_dict({"tiers": [{"url": "cpu", "tenant_quota": bad}]})


def test_tenant_quota_parses_sizes_and_the_cache_server_tier_points_to_its_flag() -> None:
    assert TierSpec.from_url("cpu?budget=1GiB&tenant_quota=64MiB").tenant_quota == 64 * 2**20
    with pytest.raises(ValueError, match="tenant_quota.*kvtier cache-server --tenant-quota"):
        create_backend(TierSpec.from_url("kvtier://127.0.0.1:1?tenant_quota=1MiB"))


def test_a_tenant_quota_below_one_chunk_is_an_error_naming_it() -> None:
    chunk = 256 * 92160
    with pytest.raises(ValueError, match=r"^tiers\[0\] cpu: tenant_quota=1024 bytes is smaller than one chunk"):
        check_tier_budgets([TierSpec.from_url("cpu?tenant_quota=1KiB")], chunk, 4)
    assert check_tier_budgets([TierSpec.from_url(f"cpu?tenant_quota={chunk}")], chunk, 4) == []
