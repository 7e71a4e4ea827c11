"""Tier limits changed at run time (issue #50, "Operating the cache"): on a real cpu tier and a
real disk directory, a budget lowered through `TierOperations.set_budget` is met before the
call returns (least recently used chunks evicted, pinned ones kept) and never passed by the puts
after it; a change the pins cannot allow is refused whole; a lowered tenant quota evicts only
the oldest chunks of the tenants past it; a Redis tier refuses by name.

What a tier holds is measured outside its accounting: the files in the directory (the state
file included), and for cpu the chunks it still contains times their size."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from harness.redis import RedisServer
from kvkeys.tenants import tenant_prefix
from kvstore.budget import BudgetError, sum_usage
from kvstore.capabilities import OperatedTier
from kvstore.storage_manager import StorageManager
from kvstore.store_config import KVStoreConfig, TierSpec

A, B = "a1" * 8, "b2" * 8


def _chunk(fill: float) -> torch.Tensor:
    return torch.full((2, 2, 16, 2, 8), fill)  # 4 KiB of float32


def _key(i: int, tag: str | None = None) -> str:
    name = f"m:float16:v1:c16:{i:032x}"  # a chunk key: usage counts chunks
    return f"kvtier:{name}" if tag is None else f"{tenant_prefix(tag)}{name}"


@pytest.fixture(params=["cpu", "disk"])
def tiers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[StorageManager, str, Path | None]]:
    """A manager over one tier (1 MiB, pins up to 64 KiB), its kind, and its directory (disk)."""
    root = tmp_path / "kv" if request.param == "disk" else None
    url = "cpu" if root is None else f"disk://{root}"
    manager = StorageManager.from_config(KVStoreConfig(tiers=[TierSpec(url, budget=1 << 20, pin_budget=64 << 10)]))
    yield manager, request.param, root
    manager.close()


def _put(manager: StorageManager, key: str) -> None:
    manager.batched_put([(key, _chunk(1.0))])


def _used(manager: StorageManager, keys: list[str], root: Path | None) -> int:
    """The bytes the tier holds, measured outside its accounting."""
    if root is not None:
        return sum(e.stat().st_size for e in os.scandir(root) if e.is_file())
    return sum(manager.tiers[0].batched_contains(keys)) * _chunk(0.0).nbytes


def _figures(manager: StorageManager) -> tuple[int, int, int | None, int, int | None]:
    b = next(iter(manager.stats().values())).backend
    return b.entries, b.bytes_used, b.byte_budget, b.pinned_bytes, b.pin_budget


def test_a_lowered_budget_is_met_at_once_and_never_passed(tiers: tuple[StorageManager, str, Path | None]) -> None:
    manager, kind, root = tiers
    tier = manager.tiers[0]
    keys = [_key(i) for i in range(40)]
    for key in keys[:12]:
        _put(manager, key)
    tier.pin(keys[:2])  # the two oldest: the first an LRU eviction would take
    size = tier.describe(keys[:1])[0].nbytes  # a disk file is the chunk plus its header
    assert size is not None
    budget = 5 * size + size // 2
    assert manager.operations.set_budget(kind, byte_budget=budget) == manager.names[0]
    assert _used(manager, keys, root) <= budget
    entries, used, byte_budget, pinned, pin_budget = _figures(manager)
    assert used <= budget and byte_budget == budget and entries == 5
    assert pinned == 2 * size and pin_budget == budget  # an unchanged pin budget above the budget becomes it
    # the pinned two survive; the rest are the three most recent, least recently used evicted first
    assert tier.batched_contains(keys[:12]) == [True] * 2 + [False] * 7 + [True] * 3
    for key in keys[12:]:
        _put(manager, key)
        assert _used(manager, keys, root) <= budget and _figures(manager)[1] <= budget
        assert tier.batched_contains(keys[:2]) == [True, True]

    # pins hold more than the change allows: refused whole, nothing changed
    before = (_figures(manager), tier.batched_contains(keys))
    for change, says in (({"byte_budget": 2 * size - 1}, "cannot be evicted"),
                         ({"pin_budget": size}, "pinned, more than the pin budget")):
        with pytest.raises(BudgetError, match=says):
            manager.operations.set_budget(kind, **change)
    for change in ({"byte_budget": -1}, {"pin_budget": budget + 1}, {}):
        with pytest.raises(ValueError):
            manager.operations.set_budget(kind, **change)
    with pytest.raises(ValueError, match="no such tier"):
        manager.operations.set_budget("redis", byte_budget=budget)
    assert (_figures(manager), tier.batched_contains(keys)) == before

    # a budget raised and a pin budget lowered to what is pinned, then the pins released
    manager.operations.set_budget(None, byte_budget=budget + 10 * size, pin_budget=2 * size)
    assert _figures(manager)[2:] == (budget + 10 * size, 2 * size, 2 * size)
    assert tier.unpin(keys[:2]) == 2
    manager.operations.set_budget(kind, byte_budget=size + size // 2)
    assert _used(manager, keys, root) <= size + size // 2 and tier.batched_contains(keys[-1:]) == [True]
    assert _figures(manager)[0] == 1 and _figures(manager)[4] == size + size // 2  # the pin budget follows


def test_a_lowered_tenant_quota_evicts_only_the_tenants_past_it(
        tiers: tuple[StorageManager, str, Path | None]) -> None:
    manager, kind, _ = tiers
    tier = manager.tiers[0]
    a, b, plain = [_key(i, A) for i in range(6)], [_key(i, B) for i in range(2)], [_key(i) for i in range(3)]
    for i in range(6):  # interleaved, so the tier's LRU order mixes the tenants
        for key in (a[i], *(b[i:i + 1]), *(plain[i:i + 1])):
            _put(manager, key)
    tier.pin(a[:1])
    size = tier.describe(a[:1])[0].nbytes
    assert size is not None
    manager.operations.set_budget(kind, tenant_quota=3 * size)
    # A keeps its pinned oldest and its two newest; B (within the quota) and unsalted keep all
    assert tier.batched_contains(a) == [True, False, False, False, True, True]
    assert tier.batched_contains(b + plain) == [True] * 5
    usage = _by_tenant(tier)
    assert usage[A] == (3, 3 * size) and usage[B] == (2, 2 * size)
    for i in range(6, 10):  # A's later puts stay within the quota, by its own LRU
        _put(manager, _key(i, A))
        assert _by_tenant(tier)[A] == (3, 3 * size)
    assert tier.batched_contains(b + plain) == [True] * 5
    with pytest.raises(BudgetError, match="tenant_quota"):
        manager.operations.set_budget(kind, tenant_quota=size - 1)  # below A's pinned chunk
    assert _by_tenant(tier)[A] == (3, 3 * size)


def _by_tenant(tier: OperatedTier) -> dict[str | None, tuple[int, int]]:
    """Returns a tier's usage summed per tenant."""
    return sum_usage((tenant, counts) for (tenant, _), counts in tier.usage().items())


def test_a_redis_tier_refuses_by_name(redis_server: RedisServer) -> None:
    with StorageManager.from_config(KVStoreConfig(tiers=[TierSpec(redis_server.url, budget=1 << 20)])) as manager:
        with pytest.raises(BudgetError, match="maxmemory"):
            manager.operations.set_budget("redis", byte_budget=1 << 10)
        assert _figures(manager)[2] == 1 << 20
