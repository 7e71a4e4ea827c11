"""Eviction policies as strategy objects (LMCache-style): a tier tells its policy about
inserts, accesses and removals, and asks it for victims in eviction order."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator


class EvictionPolicy(ABC):
    """Keeps an eviction order over a tier's keys. Not thread-safe: the tier's lock guards it."""

    name: str

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def on_insert(self, key: str) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    @abstractmethod
    def on_access(self, key: str) -> None:
        """Records a read of `key`."""

    def on_remove(self, key: str) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[str]:
        """Yields keys in the order they should be evicted (a snapshot; safe to remove while iterating)."""
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def on_access(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)


class FIFOPolicy(EvictionPolicy):
    """Oldest insert first; reads do not change the order."""

    name = "fifo"

    def on_access(self, key: str) -> None:
        pass


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "fifo": FIFOPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """Returns a new policy called `name`; raises ValueError naming the valid choices."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
