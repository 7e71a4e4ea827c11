"""A background thread running jobs from a bounded queue, so serving never waits on a slow
tier: the slower tiers' writes, the connector's stores and its loads.

When the queue is full a job is dropped (the oldest queued one, or the new one) and
counted; `submit` never blocks. `flush()` waits until everything queued has been written;
`close(timeout)` runs what is queued for at most `timeout` seconds, then drops the rest.
Every submitted job either runs or, dropped under either policy, has its `on_drop` called,
exactly once: callers that track pending work release it there, whatever the policy.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable

from kvstore.deadlines import FLUSH_TIMEOUT_S

logger = logging.getLogger("kvtier.kvstore")

Job = Callable[[], None]

BACKGROUND_NICE = 10
"""Niceness added to threads that work in the background of serving (slower tiers' writes,
the connector's loads and stores): they take the CPU the serving threads leave idle, so a
running batch's steps slow down little while they work (benchmarks/bench_vllm.py, "stall")."""


class BackgroundQueue:
    """One worker thread draining a bounded FIFO of jobs."""

    def __init__(self, max_queue: int = 64, drop: str = "drop_oldest", name: str = "kvstore-writer",
                 nice: int = 0) -> None:
        if max_queue <= 0:
            raise ValueError(f"max_queue must be > 0, got {max_queue}")
        if drop not in ("drop_oldest", "drop_new"):
            raise ValueError(f"drop must be 'drop_oldest' or 'drop_new', got {drop!r}")
        self.max_queue = max_queue
        self.drop = drop
        self.dropped = 0
        self.done = 0
        self._queue: deque[tuple[Job, Job | None]] = deque()  # (job, on_drop)
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._nice = nice
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job, on_drop: Job | None = None) -> bool:
        """Queues `job`; returns False if it (or, with drop_oldest, an older job) was dropped.
        The dropped job's `on_drop` runs (on this thread, after the queue is updated)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("background writer is closed")
            accepted = len(self._queue) < self.max_queue
            released: Job | None = None
            if not accepted:
                self.dropped += 1
                if self.drop == "drop_new":
                    released = on_drop
                else:
                    released = self._queue.popleft()[1]
            if accepted or self.drop == "drop_oldest":
                self._queue.append((job, on_drop))
                self._cond.notify_all()
        if released is not None:
            released()
        return accepted

    def pending(self) -> int:
        """Returns the jobs not finished yet: those queued plus the one running."""
        with self._cond:
            return len(self._queue) + int(self._busy)

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every queued job has run; returns False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float | None = FLUSH_TIMEOUT_S) -> int:
        """Runs what is queued for at most `timeout` seconds (None: however long it takes),
        then drops what is still queued (each dropped job's `on_drop` runs, on this thread)
        and stops the worker. Returns how many jobs were dropped. A job still running past
        the bound is left to the worker (a daemon thread), which stops after it."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)
            left = list(self._queue)
            self._queue.clear()
            self.dropped += len(left)
            self._cond.notify_all()
        for _, on_drop in left:
            if on_drop is not None:
                on_drop()
        if not left:
            self._thread.join(timeout)
        return len(left)

    def _run(self) -> None:
        if self._nice:
            lower_thread_priority(self._nice)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return  # closed and drained
                job, _ = self._queue.popleft()
                self._busy = True
            try:
                job()
            except Exception:  # a job must never kill the writer
                logger.exception("kvstore background write failed")
            finally:
                with self._cond:
                    self._busy = False
                    self.done += 1
                    self._cond.notify_all()


def lower_thread_priority(nice: int) -> None:
    """Raises this thread's niceness by `nice` (Linux schedules threads one by one), so the
    serving threads win the CPU while both want it. Best effort: a no-op where unsupported."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except (AttributeError, OSError):
        pass
