"""What each tier stored, evicted or lost, told to one listener (the connector's presence), and
the latest evictions of each tier in this process's memory remembered, so a miss there can be
explained as an eviction or as never stored (a shared tier's other users evict too: this
process cannot tell)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from kvstore.capabilities import LOCAL_TIERS

EVICTIONS_REMEMBERED = 16384
"""How many of its latest evicted keys the manager remembers per local tier: about 200 bytes
each, some 3 MiB per tier at most."""


class TierListener(Protocol):
    """Told what each tier (by its `name`: "cpu", "disk", "redis", ...) now holds or lost."""

    def stored(self, tier: str, keys: list[str]) -> None: ...

    def removed(self, tier: str, keys: list[str]) -> None: ...


class TierEvents:
    """One per storage manager. Thread-safe; `evicted` may run under a tier's lock, so nothing
    here calls a tier."""

    def __init__(self, kinds: Sequence[str]) -> None:
        self.kinds = list(kinds)  # per tier index, its kind (`StorageBackend.name`)
        self.listener: TierListener | None = None
        self._lock = threading.Lock()
        self._evictions: list[OrderedDict[str, None]] = [OrderedDict() for _ in self.kinds]
        self.remembers = [kind in LOCAL_TIERS for kind in self.kinds]  # per tier: evictions kept

    def stored(self, tier: int, keys: list[str]) -> None:
        """Records that tier `tier` now holds `keys` (no longer evicted) and tells the listener."""
        if not keys:
            return
        with self._lock:
            log = self._evictions[tier]
            if log:
                for key in keys:
                    log.pop(key, None)
        if self.listener is not None:
            self.listener.stored(self.kinds[tier], keys)

    def evicted(self, tier: int, keys: list[str]) -> None:
        """Remembers `keys` as evicted by tier `tier` (a local one) to make room and tells the listener."""
        if self.remembers[tier]:
            with self._lock:
                log = self._evictions[tier]
                for key in keys:
                    log[key] = None
                    log.move_to_end(key)
                while len(log) > EVICTIONS_REMEMBERED:
                    log.popitem(last=False)
        if self.listener is not None:
            self.listener.removed(self.kinds[tier], keys)

    def removed(self, tier: int, keys: list[str]) -> None:
        """Tells the listener a caller removed `keys` from tier `tier` (not an eviction)."""
        if keys and self.listener is not None:
            self.listener.removed(self.kinds[tier], keys)

    def cleared(self, tier: int) -> None:
        """Forgets tier `tier`'s evictions (it was cleared)."""
        with self._lock:
            self._evictions[tier].clear()

    def recently_evicted(self, tier: int, keys: Sequence[str]) -> list[bool] | None:
        """Returns per key whether it is among the latest keys tier `tier` evicted (and not stored
        since); None for a tier whose evictions are not all seen here (`remembers`)."""
        if not self.remembers[tier]:
            return None
        with self._lock:
            log = self._evictions[tier]
            return [key in log for key in keys]
