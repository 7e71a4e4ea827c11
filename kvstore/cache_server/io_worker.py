"""A background thread that runs blocking jobs in order, off the cache server's event loop.

Jobs run one at a time, in submission order (so writes, reads and removals of one file
keep the order in which the event loop issued them). A job's result is handed back to the
submitting thread: it is queued, and `wake(run_completions)` (the loop's
`call_soon_threadsafe`) asks that thread to run the completion callbacks. Without a wake
function, completions run when the owner calls `run_completions` or `drain` (tests, shutdown).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

Job = Callable[[], Any]
Done = Callable[[Any], None]


def _nothing() -> None:
    return None


class IOWorker:
    """One daemon thread running submitted jobs FIFO; completions run on the owner's thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        # (job, its completion, an event set once its result is queued) or None: stop
        self._jobs: queue.SimpleQueue[tuple[Job, Done | None, threading.Event | None] | None] = queue.SimpleQueue()
        self._done: deque[tuple[Done, Any]] = deque()
        self.wake: Callable[[Callable[[], None]], object] | None = None
        self.pending = 0  # jobs with a completion that has not run yet (owner's thread)
        self.finished = 0  # jobs run so far (written by the thread only: a progress mark)
        self._stopped = False  # stop() was called: nothing queued after it ever runs
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job, done: Done | None = None) -> None:
        """Queues `job`; `done(result)` later runs on the owner's thread (after every
        completion of an earlier job). A job that raises is logged; its result is None."""
        self.pending += done is not None
        self._jobs.put((job, done, None))

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, done, finished = item
            try:
                result = job()
            except Exception:  # a bug, not a disk error (jobs handle OSError): keep serving
                log.exception("%s: background job failed", self.name)
                result = None
            self.finished += 1
            if finished is not None:
                finished.set()
            if done is None:
                continue
            self._done.append((done, result))
            wake = self.wake
            if wake is not None:
                try:
                    wake(self.run_completions)
                except RuntimeError:  # the loop is closed: the owner drains at shutdown
                    pass

    def run_completions(self) -> None:
        """Runs the completion callbacks of finished jobs, in order (owner's thread only)."""
        while self._done:
            done, result = self._done.popleft()
            self.pending -= 1
            done(result)

    def drain(self, stall_timeout: float | None = None) -> bool:
        """Blocks until every job submitted so far has run, then runs their completions;
        returns True (pending == 0, unless a completion submitted more). With
        `stall_timeout`, returns False instead once no job has finished for that long
        (a stuck disk; between one and two timeouts): the completions of the jobs that did
        finish have run, the rest are still queued. After `stop()`, waits for the thread to
        end instead (a marker queued behind the stop would never run)."""
        if self._stopped:
            self._thread.join(stall_timeout)
            self.run_completions()
            return not self._thread.is_alive()
        done = threading.Event()
        self._jobs.put((_nothing, None, done))
        if stall_timeout is None:
            done.wait()
        else:
            seen = self.finished
            while not done.wait(stall_timeout):
                if self.finished == seen:
                    self.run_completions()
                    return False
                seen = self.finished
        self.run_completions()
        return True

    def close(self, stall_timeout: float | None = None) -> bool:
        """Drains (see `drain`), then stops the thread; returns whether every job ran. A
        thread stuck in a job is left behind (a daemon: it never holds up the process's exit)."""
        drained = self.drain(stall_timeout)
        self.stop()
        if drained:
            self._thread.join()
        return drained

    def stop(self) -> None:
        """Has the thread exit once the jobs queued so far have run (without waiting); a
        second call does nothing."""
        if not self._stopped:
            self._stopped = True
            self._jobs.put(None)
