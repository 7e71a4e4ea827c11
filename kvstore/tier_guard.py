"""One tier's calls as the storage manager and the tier operations make them: through the
tier's read and write circuit breakers (kvstore/health.py), timed against its deadlines
(kvstore/deadlines.py), and counted in its `TierStats`. On the data path (`call`) a failure
never reaches the caller: it gets `SKIPPED` (a miss). An operation (`operate`) is told why.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Final, Literal, TypeVar

import torch

from kvstore.backend import BackendError, BackendStats, StorageBackend
from kvstore.capabilities import RemoteTier
from kvstore.deadlines import CallKind
from kvstore.health import CircuitBreaker
from kvstore.tier_stats import TierStats

T = TypeVar("T")


class _Skip(enum.Enum):
    SKIPPED = enum.auto()


SKIPPED: Final = _Skip.SKIPPED
"""What `TierGuard.call` answers when the breaker is open or the call just failed (an enum
member, so `is` narrows types)."""
Skipped = Literal[_Skip.SKIPPED]


class TierUnavailable(BackendError):
    """An operation on a tier whose breaker is open: it failed lately and is backing off."""


class TierGuard:
    """One tier, its two breakers and its counters. Thread-safe (counters under `lock`, which
    the manager shares across its tiers)."""

    def __init__(self, tier: StorageBackend, name: str, lock: threading.Lock, backoff_initial_s: float,
                 backoff_max_s: float, failures: int) -> None:
        self.tier = tier
        self.name = name
        self.lock = lock
        self.counters = TierStats(name=name)
        # reads of a remote tier are probed off the serving path (one round trip within its
        # lookup deadline); other breakers let the next real call probe
        self.reads = CircuitBreaker(name, backoff_initial_s, backoff_max_s, "reads", failures,
                                    probe=tier.check if isinstance(tier, RemoteTier) else None)
        self.writes = CircuitBreaker(name, backoff_initial_s, backoff_max_s, "writes", failures)

    def call(self, fn: Callable[[], T], kind: CallKind) -> T | Skipped:
        """Returns fn()'s result, or SKIPPED if the breaker for reads (lookups, loads) or writes
        is open or this call just failed. A remote tier's call that fails or ends past its
        deadline is counted in `timeouts` (a late answer is still used: it is valid)."""
        try:
            return self.operate(fn, kind)
        except Exception:  # any tier failure is a miss for the caller, never a crash
            return SKIPPED

    def operate(self, fn: Callable[[], T], kind: CallKind, refusals: tuple[type[Exception], ...] = ()) -> T:
        """Returns fn()'s result through the same breaker, deadline and counters as `call`;
        raises TierUnavailable when that breaker is open, and fn()'s own error when it fails.
        `refusals`: errors that are the tier's answer (a PinError: over the pin budget), which
        never count against its breaker."""
        breaker = self.writes if kind == "write" else self.reads
        if not breaker.available():
            with self.lock:
                self.counters.skipped += 1
            raise TierUnavailable(f"tier {self.name} is backing off after failing "
                                  f"({breaker.last_error or 'no answer'}); it is retried after a cool-down")
        started = time.monotonic()
        try:
            result = fn()
        except Exception as exc:
            if isinstance(exc, refusals):
                breaker.succeeded(started)
                raise
            breaker.failed(exc)
            with self.lock:
                self.counters.errors += 1
                self.counters.timeouts += self._late(kind, started)
                self.counters.last_error = breaker.last_error
            raise
        breaker.succeeded(started)
        if self._late(kind, started):
            with self.lock:
                self.counters.timeouts += 1
        return result

    def store(self, items: Sequence[tuple[str, torch.Tensor]], owned: bool = False) -> list[bool] | Skipped:
        """Returns per item whether the tier accepted it (`batched_put` through the write breaker),
        or SKIPPED; counts the bytes it accepted (a chunk larger than its budget is refused, not
        stored) and the time the put took."""
        t0 = time.perf_counter()
        accepted = self.call(partial(self.tier.batched_put, items, owned=owned), "write")
        if accepted is not SKIPPED:
            with self.lock:
                self.counters.bytes_stored += sum(kv.nbytes for (_, kv), ok in zip(items, accepted) if ok)
                self.counters.store_seconds += time.perf_counter() - t0
        return accepted

    def _late(self, kind: CallKind, started: float) -> bool:
        tier = self.tier
        return isinstance(tier, RemoteTier) and time.monotonic() - started >= tier.deadlines.for_call(kind)

    def unreachable(self, exc: BaseException) -> None:
        """Opens both breakers (at start-up: the tier did not answer; the caller logged why)."""
        self.reads.failed(exc, log=False)
        self.writes.failed(exc, log=False)

    def snapshot(self) -> TierStats:
        """Returns the counters with the breakers' states and the tier's own stats (not asked
        while reads are failing: a stats read is no health probe)."""
        backend = BackendStats()
        if self.reads.healthy:
            try:
                backend = self.tier.stats()
            except Exception:
                pass
        with self.lock:
            s = TierStats(**{**vars(self.counters)})
        s.read_healthy, s.write_healthy = self.reads.healthy, self.writes.healthy
        s.healthy = s.read_healthy and s.write_healthy
        s.read_breaker, s.write_breaker = int(self.reads.state), int(self.writes.state)
        s.breaker_opens = self.reads.opens + self.writes.opens
        s.backend = backend
        return s
