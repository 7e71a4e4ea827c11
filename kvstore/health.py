"""Health of one tier: a circuit breaker per kind of call (docs/architecture.md, "Tiers and the
storage manager").

closed -> open after `failures` consecutive failed calls (errors, and remote calls that missed
their deadline: kvstore/deadlines.py); while open, calls are not made (the caller sees a miss
and recomputes); after a cool-down (`backoff_initial_s`, doubling per failed probe up to
`backoff_max_s`) the breaker is half-open: one probe decides, closed on success, open again
on failure. With a `probe` (reads: the tier's `check()`, one round trip) the probe runs on its
own thread, so a frozen tier costs the serving path one deadline when the breaker opens and
nothing after; without one (writes, which run in the background anyway) the next real call is
the probe.

The storage manager keeps one breaker for a tier's reads and one for its writes, so a tier
that refuses writes (a full Redis under `noeviction`, a read-only directory) still serves
reads. Transitions are logged once (failing -> recovered), never per call.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable

from kvstore.deadlines import BACKOFF_INITIAL_S, BACKOFF_MAX_S

logger = logging.getLogger("kvtier.kvstore")

BREAKER_FAILURES = 1
"""Default consecutive failures that open a breaker: one, since each failure of a frozen
remote tier costs the serving path a whole deadline."""


class BreakerState(enum.IntEnum):
    """A breaker's state; the values are what /metrics shows."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class CircuitBreaker:
    """Whether one kind of call (`what`: "reads" or "writes") to a tier may be made now.
    Thread-safe."""

    def __init__(self, name: str, backoff_initial_s: float = BACKOFF_INITIAL_S,
                 backoff_max_s: float = BACKOFF_MAX_S, what: str = "calls", failures: int = BREAKER_FAILURES,
                 probe: Callable[[], None] | None = None) -> None:
        if failures < 1:
            raise ValueError(f"breaker failures must be >= 1, got {failures}")
        self.name = name
        self.what = what
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.failures = failures
        self.state = BreakerState.CLOSED
        self.last_error = ""
        self.opens = 0  # times the breaker went from closed to open
        self._consecutive = 0
        self._backoff = backoff_initial_s
        self._next_try = 0.0
        self._failed_at = 0.0
        self._probe = probe
        self._probing = False
        self._lock = threading.Lock()

    @property
    def healthy(self) -> bool:
        """Returns whether the breaker is closed (calls are made)."""
        return self.state is BreakerState.CLOSED

    def available(self) -> bool:
        """Returns True if the call may be made now: closed, or half-open with this caller as
        the one probe (no `probe` callable). Starts the background probe when one is due."""
        if self.state is BreakerState.CLOSED:
            return True
        with self._lock:
            if self.state is BreakerState.CLOSED:
                return True
            now = time.monotonic()
            # half-open past its cool-down too: a probe that never reported must not stop probing
            if now < self._next_try:
                return False
            self.state = BreakerState.HALF_OPEN
            self._next_try = now + self._backoff
            if self._probe is None:
                return True  # this call is the probe
            if not self._probing:
                self._probing = True
                threading.Thread(target=self._run_probe, name=f"kvstore-probe-{self.name}", daemon=True).start()
            return False

    def _run_probe(self) -> None:
        assert self._probe is not None
        started = time.monotonic()
        try:
            self._probe()
        except Exception as exc:
            self.failed(exc)
        else:
            self.succeeded(started)
        finally:
            with self._lock:
                self._probing = False

    def failed(self, exc: BaseException, log: bool = True) -> None:
        """Records a failed call: opens the breaker after `failures` in a row (a failed probe
        reopens it with a doubled cool-down, capped). `log=False`: the caller has already
        said why (one warning for reads and writes)."""
        with self._lock:
            self.last_error = f"{type(exc).__name__}: {exc}"
            self._consecutive += 1
            now = time.monotonic()
            if self.state is BreakerState.CLOSED:
                if self._consecutive < self.failures:
                    return
                self.opens += 1
                self._backoff = self.backoff_initial_s
                if log:
                    logger.warning("kvstore tier %s: %s failing, skipping them for now: %s", self.name, self.what,
                                   self.last_error)
            else:
                self._backoff = min(self._backoff * 2, self.backoff_max_s)
            self.state = BreakerState.OPEN
            self._failed_at = now
            self._next_try = now + self._backoff

    def succeeded(self, started_at: float) -> None:
        """Records a successful call that began at `started_at` (time.monotonic()): the breaker
        closes, unless the call began before the last failure (it says nothing about the tier
        now; counting it would make the state flap during an outage)."""
        if self.state is BreakerState.CLOSED and not self._consecutive:
            return
        with self._lock:
            if started_at <= self._failed_at:
                return
            self._consecutive = 0
            if self.state is not BreakerState.CLOSED:
                self.state = BreakerState.CLOSED
                self._backoff = self.backoff_initial_s
                logger.warning("kvstore tier %s: %s recovered", self.name, self.what)
