"""Eviction policies as strategy objects (LMCache-style): a tier tells its policy about
inserts, accesses and removals, and asks it for victims in eviction order and whether a new key
may displace them (admission).

The one home of an eviction order under kvstore/: the tiers, the cache server's memory and its
disk spill all keep theirs here, through a `ByteBudget` (kvstore/budget.py). Keys are the
owner's: `str` for the tiers, `bytes` for the cache server.

The policies, measured on production traces by `make bench-trace` (benchmarks/results/trace_replay.md):
- `lru`: least recently used first, the default (`DEFAULT_POLICY`): no other policy beat it on
  both of Mooncake's traces;
- `fifo`: oldest insert first;
- `arc`: Adaptive Replacement Cache (Megiddo and Modha): recency and frequency lists whose
  balance follows hits on the keys each recently lost;
- `admit2`: LRU that lets a new key displace others only on its second sighting (a doorkeeper);
- `reuse`: predicts a key's reuse from how often it was used lately (GreedyDual over a learned
  value); the best on the conversation trace.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from sortedcontainers import SortedList

K = TypeVar("K", str, bytes)


class EvictionPolicy(ABC, Generic[K]):
    """Keeps an eviction order over a tier's keys. Not thread-safe: the tier's lock guards it."""

    name: str

    @abstractmethod
    def on_insert(self, key: K) -> None:
        """Records that `key` was stored (or stored again)."""

    @abstractmethod
    def on_access(self, key: K) -> None:
        """Records a read of `key`."""

    @abstractmethod
    def on_remove(self, key: K) -> None:
        """Forgets `key` (evicted or deleted); unknown keys are ignored."""

    @abstractmethod
    def order(self) -> Iterator[K]:
        """Yields keys in the order they should be evicted, without a copy: the caller changes
        nothing (no insert, access or removal) until it is done iterating."""

    @abstractmethod
    def __len__(self) -> int: ...

    def victims(self) -> Iterator[K]:
        """Yields keys in the order they should be evicted (a snapshot; safe to remove while iterating)."""
        return iter(list(self.order()))

    def admit(self, key: K) -> bool:
        """Returns whether `key`, not held, may displace held keys; asked only when storing it
        needs an eviction. True unless the policy filters admissions."""
        return True


class _OrderedPolicy(EvictionPolicy[K]):
    """One queue, evicted from its front."""

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def on_insert(self, key: K) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_remove(self, key: K) -> None:
        self._order.pop(key, None)

    def order(self) -> Iterator[K]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


class LRUPolicy(_OrderedPolicy[K]):
    """Least recently used first."""

    name = "lru"

    def on_access(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)


class FIFOPolicy(_OrderedPolicy[K]):
    """Oldest insert first; reads do not change the order."""

    name = "fifo"

    def on_access(self, key: K) -> None:
        pass


class _Sightings(Generic[K]):
    """The keys used lately, held or not, with how often each was used (capped), oldest first;
    bounded to `factor` times the keys the policy holds (at least `floor`)."""

    def __init__(self, factor: int, floor: int = 64, cap: int = 3) -> None:
        self.factor, self.floor, self.cap = factor, floor, cap
        self._seen: OrderedDict[K, int] = OrderedDict()

    def record(self, key: K, held: int) -> int | None:
        """Records a use of `key`; returns how often it was used before (None: not seen lately)."""
        before = self._seen.pop(key, None)
        self._seen[key] = min(self.cap, 0 if before is None else before + 1)
        bound = self.factor * max(held, self.floor)
        while len(self._seen) > bound:
            self._seen.popitem(last=False)
        return before

    def __contains__(self, key: K) -> bool:
        return key in self._seen


class AdmitOnSecondPolicy(EvictionPolicy[K]):
    """LRU whose new keys displace held ones only when seen before (a doorkeeper over the last
    four times as many keys as are held); while there is room every key is stored."""

    name = "admit2"

    def __init__(self) -> None:
        self._lru: LRUPolicy[K] = LRUPolicy()
        self._seen: _Sightings[K] = _Sightings(factor=4)

    def on_insert(self, key: K) -> None:
        self._lru.on_insert(key)
        self._seen.record(key, len(self))

    def on_access(self, key: K) -> None:
        self._lru.on_access(key)
        self._seen.record(key, len(self))

    def on_remove(self, key: K) -> None:
        self._lru.on_remove(key)

    def order(self) -> Iterator[K]:
        return self._lru.order()

    def __len__(self) -> int:
        return len(self._lru)

    def admit(self, key: K) -> bool:
        if key in self._seen:
            return True
        self._seen.record(key, len(self))
        return False


class ARCPolicy(EvictionPolicy[K]):
    """Adaptive Replacement Cache: keys used once (`t1`) and more than once (`t2`), each with a
    ghost list of the keys it lost (`b1`, `b2`); a new key found in a ghost list moves the target
    size of `t1` toward the list that would have kept it. Capacity is the keys held (a tier is
    bounded in bytes, not keys), so each ghost list keeps at most as many keys as are held."""

    name = "arc"

    def __init__(self) -> None:
        self.t1: OrderedDict[K, None] = OrderedDict()
        self.t2: OrderedDict[K, None] = OrderedDict()
        self.b1: OrderedDict[K, None] = OrderedDict()
        self.b2: OrderedDict[K, None] = OrderedDict()
        self.target = 0.0  # the size `t1` should have

    def on_insert(self, key: K) -> None:
        if key in self.t1 or key in self.t2:
            self.on_access(key)
            return
        held = max(len(self), 1)
        if key in self.b1:
            self.target = min(held, self.target + max(len(self.b2) / max(len(self.b1), 1), 1.0))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.target = max(0.0, self.target - max(len(self.b1) / max(len(self.b2), 1), 1.0))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None

    def on_access(self, key: K) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def on_remove(self, key: K) -> None:
        for live, ghost in ((self.t1, self.b1), (self.t2, self.b2)):
            if key in live:
                del live[key]
                ghost[key] = None
                while len(ghost) > max(len(self), 1):
                    ghost.popitem(last=False)
                return

    def order(self) -> Iterator[K]:
        first, second = (self.t1, self.t2) if len(self.t1) > self.target else (self.t2, self.t1)
        return itertools.chain(first, second)

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)


class ReusePolicy(EvictionPolicy[K]):
    """Predicts reuse: GreedyDual (Cao and Irani) with a learned value. Each use of a key gives it
    the priority `clock + value`, where value is the share of keys used as often lately (0, 1,
    2, 3+ times within the last four times as many keys as are held) that were used again; the
    lowest priority leaves first, and each removal raises the clock to its priority, at most to
    the lowest one still held (a deletion, or a key stored again, ages nothing), so keys not
    used for long age out as under LRU while keys whose kind tends to come back stay longer.
    It learns from the keys stored and read, and needs nothing else from a request."""

    name = "reuse"

    def __init__(self) -> None:
        self._seen: _Sightings[K] = _Sightings(factor=4)
        self._uses: dict[int, int] = {}  # uses seen lately -> keys so used (prior: 2)
        self._reused: dict[int, int] = {}  # uses seen lately -> of those, used again (prior: 1)
        self._entry: dict[K, tuple[float, int]] = {}
        self._sorted: SortedList = SortedList()  # (priority, sequence, key)
        self._seq = itertools.count()
        self._clock = 0.0

    def _value(self, uses: int) -> float:
        return (self._reused.get(uses, 0) + 1) / (self._uses.get(uses, 0) + 2)

    def _use(self, key: K) -> None:
        before = self._seen.record(key, len(self))
        if before is not None:
            self._reused[before] = self._reused.get(before, 0) + 1
        uses = 0 if before is None else min(before + 1, self._seen.cap)
        self._uses[uses] = self._uses.get(uses, 0) + 1
        if self._uses[uses] > 1 << 20:  # halve the counts: the traffic may change
            self._uses = {u: n // 2 for u, n in self._uses.items()}
            self._reused = {u: n // 2 for u, n in self._reused.items()}
        self._drop(key)
        priority, seq = self._clock + self._value(uses), next(self._seq)
        self._entry[key] = (priority, seq)
        self._sorted.add((priority, seq, key))

    def _drop(self, key: K) -> float | None:
        entry = self._entry.pop(key, None)
        if entry is None:
            return None
        priority, seq = entry
        self._sorted.remove((priority, seq, key))
        return priority

    def on_insert(self, key: K) -> None:
        self._use(key)

    def on_access(self, key: K) -> None:
        if key in self._entry:
            self._use(key)

    def on_remove(self, key: K) -> None:
        priority = self._drop(key)
        if priority is not None:  # an eviction takes the lowest: the clock becomes its priority
            lowest = self._sorted[0][0] if self._sorted else priority
            self._clock = max(self._clock, min(priority, lowest))

    def order(self) -> Iterator[K]:
        return (key for _, _, key in self._sorted)

    def __len__(self) -> int:
        return len(self._entry)


POLICIES: dict[str, type[EvictionPolicy[Any]]] = {
    p.name: p for p in (LRUPolicy, FIFOPolicy, ARCPolicy, AdmitOnSecondPolicy, ReusePolicy)}

DEFAULT_POLICY = "lru"
"""The policy a tier, the cache server and its spill use unless told otherwise."""


def make_policy(name: str = DEFAULT_POLICY) -> EvictionPolicy[Any]:
    """Returns a new policy called `name` (over the key type of the budget it is given to);
    raises ValueError naming the valid choices."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
