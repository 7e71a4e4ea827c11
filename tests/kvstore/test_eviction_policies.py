"""The eviction policies (kvstore/eviction.py) through the real tiers: every policy keeps the
budget exact and orders exactly the keys held; ARC keeps what was used twice through a scan;
the admission filter lets a new key displace others only on its second sighting, in a tier and
in the cache server's store; the reuse policy keeps the keys that come back where LRU loses
them. Their hit rates on production traces are `make bench-trace`'s (tests/test_bench_trace.py)."""

from __future__ import annotations

import random

import pytest
import torch

from kvstore.backends.memory import CPUBackend
from kvstore.budget import ByteBudget
from kvstore.cache_server.server import StoreBudgets
from kvstore.cache_server.store import ByteStore
from kvstore.eviction import DEFAULT_POLICY, POLICIES, make_policy

VALUE = torch.zeros(8, dtype=torch.float32)  # 32 bytes
ITEM = VALUE.numel() * VALUE.element_size()


def _tier(policy: str, keys: int) -> CPUBackend:
    return CPUBackend(byte_budget=keys * ITEM, eviction=policy)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_keeps_the_budget_and_orders_exactly_the_keys_held(policy: str) -> None:
    rng = random.Random(7)
    budget = ByteBudget(10 * 100, make_policy(policy))
    for _ in range(3000):
        key = f"k{rng.randrange(60)}"
        op = rng.random()
        if op < 0.5:
            victims = budget.plan(key, 100)
            if victims is not None:
                for v in victims:
                    budget.remove(v)
                budget.add(key, 100)
        elif op < 0.9:
            budget.touch(key)
        else:
            budget.remove(key)
        assert budget.used <= 1000
        assert sorted(budget.policy.order()) == sorted(budget.sizes)
        assert len(budget.policy) == len(budget.sizes)
    budget.clear()
    assert len(budget.policy) == 0 and list(budget.policy.order()) == []


def test_default_policy_is_a_known_one_and_unknown_names_are_refused() -> None:
    assert DEFAULT_POLICY in POLICIES and make_policy().name == DEFAULT_POLICY
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'; choose one of"):
        CPUBackend(byte_budget=100, eviction="mru")


def test_arc_keeps_a_key_used_twice_through_a_scan_that_lru_loses_it_to() -> None:
    kept = {}
    for policy in ("lru", "arc"):
        tier = _tier(policy, 4)
        tier.batched_put([("hot", VALUE)])
        tier.batched_get(["hot"])  # used twice
        for i in range(6):  # a scan of keys used once
            tier.batched_put([(f"scan{i}", VALUE)])
        kept[policy] = tier.batched_contains(["hot"])[0]
    assert kept == {"lru": False, "arc": True}


def test_admission_filter_lets_a_new_key_in_on_its_second_sighting() -> None:
    tier = _tier("admit2", 2)
    assert tier.batched_put([("a", VALUE), ("b", VALUE)]) == [True, True]  # room: no filter
    assert tier.batched_put([("c", VALUE)]) == [False]  # first sighting, the tier is full
    assert tier.batched_contains(["a", "b", "c"]) == [True, True, False]
    assert tier.batched_put([("c", VALUE)]) == [True]  # seen before: displaces the oldest
    assert tier.batched_contains(["a", "b", "c"]) == [False, True, True]
    assert tier.stats().rejected == 1


def test_cache_server_store_filters_admissions_by_its_policy() -> None:
    size = len(b"k0") + ITEM
    store = ByteStore(max_bytes=2 * size, eviction="admit2", pin_budget=0)
    value = bytes(ITEM)
    assert store.put(b"k0", value) and store.put(b"k1", value)
    assert not store.put(b"k2", value)  # full, first sighting: refused, nothing lost
    assert store.get(b"k0") is not None and store.get(b"k1") is not None
    assert store.put(b"k2", value)  # second sighting
    assert store.rejected == 1 and store.evictions == 1


def test_cache_server_eviction_flag_names_the_choices() -> None:
    assert StoreBudgets(eviction="reuse").validate().eviction == "reuse"
    with pytest.raises(ValueError, match=r"--eviction: unknown policy 'mru'; choose one of"):
        StoreBudgets(eviction="mru").validate()


def _hits(policy: str) -> int:
    """Rounds of 5 keys read every round, each round followed by 10 keys used once, through a
    tier of 10 keys: returns the reads that hit."""
    tier = _tier(policy, 10)
    hits = 0
    for r in range(60):
        hot = [f"hot{i}" for i in range(5)]
        held = tier.batched_contains(hot)
        hits += sum(held)
        tier.batched_get([k for k, h in zip(hot, held) if h])
        tier.batched_put([(k, VALUE) for k, h in zip(hot, held) if not h])
        tier.batched_put([(f"once{r}.{i}", VALUE) for i in range(10)])
    return hits


def test_reuse_policy_keeps_the_keys_that_come_back_where_lru_loses_them() -> None:
    lru, reuse = _hits("lru"), _hits("reuse")
    assert lru == 0  # 15 keys a round through 10 places: LRU evicts each hot key before its next use
    assert reuse >= 0.8 * 5 * 59, (lru, reuse)  # it learns that keys used before come back


def test_reuse_policy_clock_never_passes_the_lowest_priority_held() -> None:
    """GreedyDual's clock is the priority of the last eviction, the lowest held: a deletion of a
    key used often (or a key stored again) must not age every other key past newcomers."""
    policy = make_policy("reuse")
    rng = random.Random(3)
    for _ in range(3000):
        key = f"k{rng.randrange(40)}"
        op = rng.random()
        if op < 0.4:
            policy.on_insert(key)
        elif op < 0.8:
            policy.on_access(key)
        else:
            policy.on_remove(key)
        held = list(policy.order())
        if held:
            lowest = policy._sorted[0][0]
            assert policy._clock <= lowest
