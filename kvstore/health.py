"""Health of one tier: a failing tier is skipped with exponential backoff and probed again later.

Transitions are logged once (healthy -> unhealthy, unhealthy -> healthy), never per call.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger("kvtier.kvstore")


class TierHealth:
    """Tracks whether a tier may be called now."""

    def __init__(self, name: str, backoff_initial_s: float = 0.5, backoff_max_s: float = 30.0) -> None:
        self.name = name
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.healthy = True
        self.failures = 0
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

    def failed(self, exc: BaseException) -> None:
        """Records a failed call: marks the tier unhealthy and doubles the backoff."""
        with self._lock:
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            if self.healthy:
                self.healthy = False
                self._backoff = self.backoff_initial_s
                logger.warning("kvstore tier %s is unhealthy, skipping it for now: %s", self.name, self.last_error)
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
                logger.warning("kvstore tier %s recovered", self.name)
