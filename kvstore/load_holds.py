"""Load holds: counts of the chunks being loaded (or copied) right now. A held chunk is never
evicted from any tier. Operator pins are another thing (kvstore/pin_set.py): they belong to a
tier, outlive requests and have a budget."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable


class LoadHolds:
    """Thread-safe hold counts. Counts never go negative: releasing a key not held raises."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def hold(self, keys: Iterable[str]) -> None:
        """Adds one hold to each key."""
        with self._lock:
            for key in keys:
                self._counts[key] += 1

    def release(self, keys: Iterable[str]) -> None:
        """Removes one hold from each key; raises ValueError (changing nothing) if any is not held."""
        keys = list(keys)
        with self._lock:
            need = Counter(keys)
            for key, n in need.items():
                if self._counts.get(key, 0) < n:
                    raise ValueError(f"release of a key that is not held: {key!r}")
            for key, n in need.items():
                left = self._counts[key] - n
                if left:
                    self._counts[key] = left
                else:
                    del self._counts[key]

    def is_held(self, key: str) -> bool:
        """Returns whether `key` is held (tiers ask it while holding their own lock: a dict read,
        atomic under the GIL, no lock taken)."""
        return self._counts.get(key, 0) > 0

    def count(self, key: str) -> int:
        """Returns how many holds `key` has."""
        with self._lock:
            return self._counts.get(key, 0)

    def total(self) -> int:
        """Returns the sum of all hold counts (0 after a balanced workload)."""
        with self._lock:
            return sum(self._counts.values())
