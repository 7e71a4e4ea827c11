"""Pin counts for chunks being loaded: a pinned chunk is never evicted from any tier."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable


class PinTable:
    """Thread-safe pin counts. Counts never go negative: unpinning an unpinned key raises."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def pin(self, keys: Iterable[str]) -> None:
        """Adds one pin to each key."""
        with self._lock:
            for key in keys:
                self._counts[key] += 1

    def unpin(self, keys: Iterable[str]) -> None:
        """Removes one pin from each key; raises ValueError (changing nothing) if any is unpinned."""
        keys = list(keys)
        with self._lock:
            need = Counter(keys)
            for key, n in need.items():
                if self._counts.get(key, 0) < n:
                    raise ValueError(f"unpin of a key that is not pinned: {key!r}")
            for key, n in need.items():
                left = self._counts[key] - n
                if left:
                    self._counts[key] = left
                else:
                    del self._counts[key]

    def is_pinned(self, key: str) -> bool:
        # a dict lookup is atomic under the GIL; tiers call this while holding their own lock
        return self._counts.get(key, 0) > 0

    def count(self, key: str) -> int:
        with self._lock:
            return self._counts.get(key, 0)

    def total(self) -> int:
        """Returns the sum of all pin counts (0 after a balanced workload)."""
        with self._lock:
            return sum(self._counts.values())
