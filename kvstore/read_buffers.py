"""Reusable receive buffers for values read into memory (the disk tier's reads).

A value read into freshly allocated memory pays a page fault per 4 KiB page, which can cost
several times the read itself into memory already touched. Whether the allocator hands
back touched memory depends on the pattern of allocations; `ReadBufferPool.take` makes it so.
Measured in the connector loader's pattern: benchmarks/bench_read_buffers.py. A buffer returns
to the pool when nothing refers to it any more: the decoded tensor views it (raw codec), so
that is when the last tensor over it is gone; no caller has to give it back.

Every view starts on a page boundary: reads from the page cache into memory 16 bytes past one
(where the allocator puts a bytearray's data) are markedly slower in the loader's pattern
(benchmarks/bench_read_buffers.py).
"""

from __future__ import annotations

import bisect
import threading
import weakref

import numpy as np

DEFAULT_MAX_FREE_BYTES = 128 << 20  # a load holds a few chunks at a time (connector/loader.py)
PAGE = 4096


def page_aligned(buf: bytearray, nbytes: int) -> np.ndarray:
    """Returns the `nbytes` of `buf` that start on its first page boundary; `buf` holds at
    least `nbytes + PAGE` bytes."""
    whole = np.frombuffer(buf, dtype=np.uint8)
    start = -whole.ctypes.data % PAGE
    return whole[start:start + nbytes]


class ReadBufferPool:
    """Free buffers by capacity, at most `max_free_bytes` of them kept. Thread-safe."""

    def __init__(self, max_free_bytes: int = DEFAULT_MAX_FREE_BYTES) -> None:
        self.max_free_bytes = max_free_bytes
        self._lock = threading.Lock()
        self._sizes: list[int] = []  # usable capacities of the free buffers, sorted (parallel to _free)
        self._free: list[bytearray] = []
        self._free_bytes = 0
        self.reused = 0  # takes served from the pool (the rest allocated fresh)

    def take(self, nbytes: int) -> memoryview:
        """Returns a writable, page-aligned view of exactly `nbytes` bytes, over a free buffer of
        at most twice that capacity when there is one (its contents are stale: write it all
        before reading), else over a new one. Its buffer comes back when the view, and
        everything made from it, is gone."""
        buf = None
        with self._lock:
            i = bisect.bisect_left(self._sizes, nbytes)
            if i < len(self._sizes) and self._sizes[i] <= 2 * nbytes:
                del self._sizes[i]
                buf = self._free.pop(i)
                self._free_bytes -= len(buf)
                self.reused += 1
        if buf is None:
            buf = bytearray(nbytes + PAGE)  # room to start the view on a page boundary
        arr = page_aligned(buf, nbytes)
        # `arr` is what every view of this value refers to (memoryview exports, torch.frombuffer):
        # when it is collected nothing reads the buffer any more.
        weakref.finalize(arr, self._give_back, buf).atexit = False
        return arr.data  # a memoryview whose exporter is `arr`

    def _give_back(self, buf: bytearray) -> None:
        with self._lock:
            if self._free_bytes + len(buf) > self.max_free_bytes:
                return  # dropped: the pool stays within its bound
            i = bisect.bisect_left(self._sizes, len(buf) - PAGE)
            self._sizes.insert(i, len(buf) - PAGE)
            self._free.insert(i, buf)
            self._free_bytes += len(buf)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._free_bytes
