"""Keeps the cache server's resident memory within what its budget explains.

`kvtier cache-server` asks glibc to keep freed memory for reuse (engine/host_memory.py
`keep_freed_memory`): buffers of evicted values then serve the next PUTs without new page
faults. With values of varied sizes the freed holes may not fit the next buffer, the heap
grows, and resident memory drifts above the budget. `ResidentGuard.check` runs before each
large allocation and, only when resident memory plus that allocation would pass the bound
(baseline + budget + allowance), hands free pages back with malloc_trim(0): below the bound
freed buffers keep their zero-fault reuse, and no client mix takes the process past it.
`trim_heap` is that one malloc_trim; `kvtier serve`'s engine loop also calls it when it goes
idle (kvtier/server/engine_loop.py).
"""

from __future__ import annotations

import ctypes
import os

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """Returns this process's resident set size in bytes (0 where /proc is absent)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _malloc_trim():  # -> ctypes function or None
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Hands the heap's free pages back to the OS (glibc's malloc_trim(0)); returns whether
    it could (False where the C library is not glibc). Live allocations are untouched."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class ResidentGuard:
    """Trims the allocator when resident memory would pass baseline + a limit."""

    def __init__(self) -> None:
        self.baseline = resident_bytes()
        self.trims = 0

    def reset_baseline(self) -> None:
        """Takes the current resident size as the idle process's (call once serving)."""
        self.baseline = resident_bytes()

    def check(self, limit: int, pending: int = 0) -> bool:
        """Returns whether it trimmed: it does when resident memory plus `pending` (bytes
        about to be allocated) exceeds the baseline plus `limit` (the budget plus what lives
        outside it: per-connection buffers, allocator slack)."""
        if _TRIM is None or resident_bytes() + pending - self.baseline <= limit:
            return False
        trim_heap()
        self.trims += 1
        return True
