"""How a kvtier process reuses host memory: glibc's malloc keeps freed blocks for the next
allocation instead of handing them back to the kernel.

A prefill step allocates and frees tens of MB of activations per layer. glibc serves blocks
over its mmap threshold (128 KiB at first) with fresh mappings, and hands a heap top freed past
its trim threshold back to the kernel, so every step faulted its activations in again: a
4k-token prefill of SmolLM2 took ~400k page faults and ~0.9 s of kernel time, 8.5 s in all
against 7.5 s without them. The cache server's values are multi-MB buffers that come and go
with every PUT and eviction, each faulted in again at about the cost of receiving its bytes.
`keep_freed_memory` raises both thresholds, as tcmalloc (the allocator vLLM's CPU docs preload)
or PyTorch's caching allocator on CUDA keep theirs. glibc then trims only when asked: `kvtier
serve`'s engine loop when it goes idle, the cache server when resident memory would pass its
bound (kvstore/server/heap.py `trim_heap`). Blocks over glibc's largest mmap threshold
(32 MiB), such as the KV pool, stay mappings: returned at free, and zero pages until written
(engine/kv_cache.py `zeroed_pool`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
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
    path = ctypes.util.find_library("c")
    if path is None:
        return False
    libc = ctypes.CDLL(path)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    if not ok:
        logger.warning("glibc refused kvtier's malloc thresholds: freed memory goes back to the kernel")
    return ok
