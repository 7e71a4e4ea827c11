"""How a kvtier process controls glibc's malloc: the one home of that, below engine and kvstore
(neither may import the other, and both need it). Stdlib only; it imports nothing of kvtier's.

Keeping freed memory. A prefill step allocates and frees tens of MB of activations per layer, and
the cache server's values are multi-MB buffers that come and go with every PUT and eviction.
glibc serves blocks over its mmap threshold (128 KiB at first) with fresh mappings and hands a
heap top freed past its trim threshold back to the kernel, so each such buffer is faulted in
again. `keep_freed_memory` raises both thresholds, as tcmalloc (the allocator vLLM's CPU docs
preload) or PyTorch's caching allocator on CUDA keep theirs; the engine's model runner calls it on
CPU, and `kvtier cache-server` at start. Blocks over glibc's largest mmap threshold (32 MiB),
such as the KV pool, stay mappings: returned at free, and zero pages until written
(engine/kv_cache.py `zeroed_pool`).

Trimming. glibc then hands memory back only when asked (`trim_heap`, its malloc_trim(0)):
`kvtier serve`'s engine loop when it goes idle (kvtier/server/engine_loop.py), and the cache
server through `ResidentGuard`, when resident memory plus the next large allocation would pass
its bound (baseline + budget + allowance). With values of varied sizes the freed holes may not
fit the next buffer and the heap grows; below the bound freed buffers keep their zero-fault
reuse, and no client mix takes the process past it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# glibc's ceiling for the mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
MMAP_THRESHOLD_BYTES = 32 << 20
# Never on its own: the largest value mallopt takes (an int).
TRIM_THRESHOLD_BYTES = 2**31 - 1

# The environment's own malloc settings, which win.
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """Returns the process's C library, once, with the signatures used here; None where it is
    not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    if not all(hasattr(libc, name) for name in ("gnu_get_libc_version", "mallopt", "malloc_trim")):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


@functools.cache
def keep_freed_memory() -> bool:
    """Sets glibc's mmap threshold to `MMAP_THRESHOLD_BYTES` and its trim threshold to
    `TRIM_THRESHOLD_BYTES` for this process, once; returns whether they were set. Not set where
    the C library is not glibc, or where the environment sets malloc's thresholds itself
    (`MALLOC_*_THRESHOLD_`, `GLIBC_TUNABLES`) or preloads another allocator."""
    if any(os.environ.get(var) for var in _USER_SETTINGS) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    if any(name in os.environ.get("LD_PRELOAD", "") for name in ("tcmalloc", "jemalloc", "mimalloc")):
        return False
    libc = _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    if not ok:
        logger.warning("glibc refused kvtier's malloc thresholds: freed memory goes back to the kernel")
    return ok


def trim_heap() -> bool:
    """Hands the heap's free pages back to the OS (glibc's malloc_trim(0)); returns whether
    it could (False where the C library is not glibc). Live allocations are untouched."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def resident_bytes() -> int:
    """Returns this process's resident set size in bytes (0 where /proc is absent)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


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
        if _glibc() is None or resident_bytes() + pending - self.baseline <= limit:
            return False
        trim_heap()
        self.trims += 1
        return True
