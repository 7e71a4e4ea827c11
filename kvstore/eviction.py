"""Eviction policies as strategy objects (LMCache-style): a tier tells its policy about
inserts, accesses and removals, and asks it for victims in eviction order.

The one home of an eviction order under kvstore/: the tiers, the cache server's memory and its
disk spill all keep theirs here, through a `ByteBudget` (kvstore/budget.py). Keys are the
owner's: `str` for the tiers, `bytes` for the cache server."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

K = TypeVar("K", str, bytes)


class EvictionPolicy(ABC, Generic[K]):
    """Keeps an eviction order over a tier's keys. Not thread-safe: the tier's lock guards it."""

    name: str

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def on_insert(self, key: K) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    @abstractmethod
    def on_access(self, key: K) -> None:
        """Records a read of `key`."""

    def on_remove(self, key: K) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[K]:
        """Yields keys in the order they should be evicted (a snapshot; safe to remove while iterating)."""
        return iter(list(self._order))

    def order(self) -> Iterator[K]:
        """Yields keys in the order they should be evicted, without a copy: the caller changes
        nothing (no insert, access or removal) until it is done iterating."""
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


class LRUPolicy(EvictionPolicy[K]):
    """Least recently used first."""

    name = "lru"

    def on_access(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)


class FIFOPolicy(EvictionPolicy[K]):
    """Oldest insert first; reads do not change the order."""

    name = "fifo"

    def on_access(self, key: K) -> None:
        pass


POLICIES: dict[str, type[EvictionPolicy[Any]]] = {"lru": LRUPolicy, "fifo": FIFOPolicy}


def make_policy(name: str) -> EvictionPolicy[Any]:
    """Returns a new policy called `name` (over the key type of the budget it is given to);
    raises ValueError naming the valid choices."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
