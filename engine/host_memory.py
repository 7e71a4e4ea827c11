"""How the engine's process reuses host memory on CPU: a step's freed activations are kept for
the next step instead of going back to the kernel.

A prefill step allocates and frees tens of MB of activations per layer. glibc's malloc serves
blocks over its mmap threshold (128 KiB at first) with fresh mappings, and hands a heap top
freed past its trim threshold back to the kernel, so every step faults its activations in
again: a 4k-token prefill of SmolLM2 took ~400k page faults and ~0.9 s of kernel time, 8.5 s in
all against 7.5 s without them. `keep_freed_memory` raises both thresholds, as tcmalloc (the
allocator vLLM's CPU docs preload) or PyTorch's caching allocator on CUDA keep theirs. Blocks
over glibc's largest mmap threshold (32 MiB), such as the KV pool, stay mappings: returned at
free, and zero pages until written (engine/kv_cache.py `zeroed_pool`).
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
# Free memory at the heap's top kept past a step: more than a step's activations on the models
# this engine runs on CPU (SmolLM2 at 4096 tokens peaks at ~150 MB).
TRIM_THRESHOLD_BYTES = 1 << 30

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
        logger.warning("glibc refused kvtier's malloc thresholds; steps will fault their activations in")
    return ok
