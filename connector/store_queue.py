"""The connector's store queue: gathered chunks go to the storage manager on a background
thread, so a step never waits for a tier; lookups can wait for the keys still in flight.

Bounded twice: by job count (kvstore's `BackgroundQueue`, under its `queue_full` policy) and
by bytes held (`max_bytes`). A dropped store is counted and forgotten, never waited for: its
keys and bytes are released whether the new job or a queued one is dropped (the writer calls
each dropped job's release), so a lookup waiting for a key never hangs on a dropped store.
Promotions of slow-tier hits to the faster tiers go through the same queue (`promote`), off
the load path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from kvstore.background_queue import BACKGROUND_NICE, BackgroundQueue
from kvstore.storage_manager import StorageManager

Item = tuple[str, torch.Tensor]


class StoreQueue:
    """Pending stores with their keys and bytes. Thread-safe; counts never go negative."""

    def __init__(self, storage: StorageManager, max_jobs: int, max_bytes: int, queue_full: str = "drop_new") -> None:
        self.storage = storage
        self.max_bytes = max_bytes
        # below the serving threads' priority, like the loader (connector/loader.py)
        self._writer = BackgroundQueue(max_jobs, queue_full, "kvtier-connector-store", nice=BACKGROUND_NICE)
        self._cond = threading.Condition()
        self._keys: dict[str, int] = {}
        self._bytes = 0
        self.promotions = 0
        # On CUDA, puts copy device -> host on their own stream, after the gather's event.
        self._stream: torch.cuda.Stream | None = None

    def submit(self, items: Sequence[Item], on_done: Callable[[], None] | None = None,
               on_drop: Callable[[], None] | None = None) -> bool:
        """Queues `items` (chunks, or views of them, the caller no longer touches); returns False, having queued
        nothing, if the byte bound or (drop_new) the job bound refuses them. `on_done` runs
        after a successful put; `on_drop` if, queued, they are dropped later (drop_oldest)."""
        items = list(items)

        def put() -> None:  # views of a gathered chunk (one per KV head) are copied out here, off the step
            self.storage.batched_put([(k, kv.contiguous()) for k, kv in items], owned=True)

        return self._enqueue(items, put, on_done, on_drop)

    def promote(self, found: Sequence[tuple[str, torch.Tensor, int]]) -> bool:
        """Queues writing each `(key, chunk, tier)` a load fetched from a slower tier into the
        faster ones (`StorageManager.promote`), so no load waits for it; returns False (nothing
        queued) under the same bounds as `submit`. `promotions` counts the chunks written."""
        found = list(found)

        def run() -> None:
            self.storage.promote([(k, kv.contiguous(), tier) for k, kv, tier in found])
            with self._cond:
                self.promotions += len(found)

        return bool(found) and self._enqueue([(k, kv) for k, kv, _ in found], run)

    def _enqueue(self, items: list[Item], put: Callable[[], None], on_done: Callable[[], None] | None = None,
                 on_drop: Callable[[], None] | None = None) -> bool:
        """Queues `put` holding `items`' keys and bytes until it ran or was dropped."""
        keys = [k for k, _ in items]
        nbytes = sum(kv.numel() * kv.element_size() for _, kv in items)
        with self._cond:
            if self._bytes + nbytes > self.max_bytes:
                return False
            self._bytes += nbytes
            for k in keys:
                self._keys[k] = self._keys.get(k, 0) + 1
        stream = self._stream_for(items)
        event = None
        if stream is not None:  # the gathers are queued on the compute stream
            event = torch.cuda.Event()
            event.record()

        def job() -> None:
            try:
                if stream is not None and event is not None:
                    with torch.cuda.stream(stream):
                        stream.wait_event(event)
                        put()
                        stream.synchronize()
                else:
                    put()
                if on_done is not None:
                    on_done()
            finally:
                self._release(keys, nbytes)

        queued = [False]

        def dropped() -> None:  # the writer dropped the job: it never runs
            self._release(keys, nbytes)
            if queued[0] and on_drop is not None:
                on_drop()

        queued[0] = self._writer.submit(job, on_drop=dropped) or self._writer.drop == "drop_oldest"
        return queued[0]

    def _stream_for(self, items: list[Item]) -> torch.cuda.Stream | None:
        """Returns the side stream for puts of CUDA tensors (created on first use), else None."""
        if not items or items[0][1].device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(items[0][1].device)
        return self._stream

    def _release(self, keys: list[str], nbytes: int) -> None:
        with self._cond:
            self._bytes -= nbytes
            for k in keys:
                left = self._keys[k] - 1
                if left:
                    self._keys[k] = left
                else:
                    del self._keys[k]
            self._cond.notify_all()

    def is_pending(self, key: str) -> bool:
        with self._cond:
            return key in self._keys

    def wait_for(self, keys: Sequence[str]) -> None:
        """Blocks until no key in `keys` has a store in flight (read-your-writes)."""
        with self._cond:
            self._cond.wait_for(lambda: not any(k in self._keys for k in keys))

    def pending(self) -> int:
        """Returns how many chunks wait to be stored."""
        with self._cond:
            return sum(self._keys.values())

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every queued store has run; returns False on timeout."""
        return self._writer.flush(timeout)

    def close(self, timeout: float | None = None) -> int:
        """Runs what is queued for at most `timeout` seconds (None: all of it), drops the rest
        (their keys released), then stops the thread; returns how many stores were dropped."""
        return self._writer.close(timeout)
