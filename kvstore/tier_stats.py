"""What the storage manager saw of one tier (`StorageManager.stats()`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.backend import BackendStats


@dataclass
class TierStats:
    """What the manager saw of one tier, plus the tier's own counters."""

    name: str
    healthy: bool = True  # reads and writes both healthy
    read_healthy: bool = True
    write_healthy: bool = True
    hits: int = 0
    misses: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    errors: int = 0
    skipped: int = 0  # calls not made because the tier's breaker was open
    timeouts: int = 0  # remote calls that failed or ended past their deadline (kvstore/deadlines.py)
    breaker_opens: int = 0  # times a breaker (reads or writes) opened
    read_breaker: int = 0  # kvstore.health.BreakerState: 0 closed, 1 open, 2 half-open
    write_breaker: int = 0
    dropped_writes: int = 0
    last_error: str = ""
    backend: BackendStats = field(default_factory=BackendStats)
