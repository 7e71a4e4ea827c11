"""The host-memory policy (hostmem `keep_freed_memory`), in a fresh interpreter each: what
glibc's malloc does with a step-sized activation with and without it (its own statistics,
`mallinfo2`). The time it saves a long prefill is in benchmarks/bench_vs_vllm.py's prefill rows."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from harness import process

REPO = Path(__file__).resolve().parents[2]

# A 24 MiB activation (a 2048-row gate/up block of SmolLM2) written, then freed: glibc's
# bytes in mappings while it lives, and its heap's size before and after.
_STEP = """
import ctypes, json, sys, torch
from hostmem import keep_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
heap_before = libc.mallinfo2().arena
x = torch.empty(24 << 20, dtype=torch.uint8).fill_(1)
mapped = libc.mallinfo2().hblkhd
del x
print(json.dumps({"kept": kept, "mapped": mapped, "heap_grew": libc.mallinfo2().arena - heap_before}))
"""


def _run(mode: str, **env: str) -> dict:
    out = process.run([sys.executable, "-c", _STEP, mode], cwd=REPO, capture_output=True, text=True,
                      timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), **env}, check=True)
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux")
def test_a_freed_activation_stays_in_the_heap() -> None:
    plain, kept = _run("plain"), _run("keep")
    assert kept["kept"] is True
    # glibc's defaults: a fresh mapping, unmapped at free (so faulted in again next step).
    assert plain["mapped"] >= 24 << 20 and plain["heap_grew"] < 8 << 20, plain
    # Kept: served from the heap, which keeps the freed block for the next step.
    assert kept["mapped"] < 24 << 20 and kept["heap_grew"] > 16 << 20, kept


def test_the_environment_s_own_malloc_settings_win() -> None:
    assert _run("keep", MALLOC_TRIM_THRESHOLD_="131072")["kept"] is False
    assert _run("keep", GLIBC_TUNABLES="glibc.malloc.trim_threshold=131072")["kept"] is False
    assert _run("keep", LD_PRELOAD="libjemalloc.so.2")["kept"] is False
