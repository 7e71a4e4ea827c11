"""Health of one tier: a failing tier is skipped with capped exponential backoff and probed again.

The storage manager keeps one `TierHealth` for a tier's reads and one for its writes, so a
tier that refuses writes (a full Redis under `noeviction`, a read-only directory) still
serves reads. Transitions are logged once (failing -> recovered), never per call.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger("kvtier.kvstore")

BACKOFF_INITIAL_S = 0.25
"""Default first backoff after a failure."""
BACKOFF_MAX_S = 1.0
"""Default cap of the backoff: a tier that is back is used again within about this long."""


class TierHealth:
    """Tracks whether one kind of call (`what`: "reads" or "writes") to a tier may be made now."""

    def __init__(self, name: str, backoff_initial_s: float = BACKOFF_INITIAL_S,
                 backoff_max_s: float = BACKOFF_MAX_S, what: str = "calls") -> None:
        self.name = name
        self.what = what
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.healthy = True
        self.last_error = ""
        self._backoff = backoff_initial_s
        self._next_try = 0.0
        self._failed_at = 0.0
        self._lock = threading.Lock()

    def available(self) -> bool:
        """Returns True if the tier may be called: healthy, or its backoff has elapsed (then this
        caller is the one probe until the next backoff; others keep skipping)."""
        if self.healthy:
            return True
        with self._lock:
            now = time.monotonic()
            if now < self._next_try:
                return False
            self._next_try = now + self._backoff
            return True

    def failed(self, exc: BaseException, log: bool = True) -> None:
        """Records a failed call: marks the tier unhealthy and doubles the backoff (capped).
        `log=False`: the caller has already said why (one warning for reads and writes)."""
        with self._lock:
            self.last_error = f"{type(exc).__name__}: {exc}"
            if self.healthy:
                self.healthy = False
                self._backoff = self.backoff_initial_s
                if log:
                    logger.warning("kvstore tier %s: %s failing, skipping them for now: %s", self.name, self.what,
                                   self.last_error)
            else:
                self._backoff = min(self._backoff * 2, self.backoff_max_s)
            self._failed_at = time.monotonic()
            self._next_try = self._failed_at + self._backoff

    def succeeded(self, started_at: float) -> None:
        """Records a successful call that began at `started_at` (time.monotonic()): an unhealthy
        tier is healthy again, unless the call began before the last failure (it says nothing
        about the tier now; counting it would make the state flap during an outage)."""
        if self.healthy:
            return
        with self._lock:
            if not self.healthy and started_at > self._failed_at:
                self.healthy = True
                self._backoff = self.backoff_initial_s
                logger.warning("kvstore tier %s: %s recovered", self.name, self.what)
