"""The engine's compiled CPU kernels (engine/csrc), built on first use and cached per machine.

- `paged_decode_attention` reads each decoding sequence's K/V in place from its blocks, where
  the PyTorch path gathers (copies) every sequence's whole context into a padded tensor once
  per layer per step: at long contexts that copy is most of a decode step
  (`benchmarks/bench_kernels.py`);
- `paged_prefill_attention` answers every float32 prefill (a fresh prompt or new tokens over
  cached context) the same way, tiled: faster than PyTorch's flash SDPA on a 4k prompt;
- the fused float32 ops of a decoder layer (`rms_norm`, `add_rms_norm` adding the residual in
  place, `silu_and_mul`) each replace several PyTorch ops and Python calls per layer per step;
- `panel_linear`, float32 linear layers over weights packed in panels (engine/linear_backend.py
  `PanelLinear`): faster than oneDNN's GEMV on a batch-1 decode step;
- `copy_kv_pages` moves a chunk's K/V into or out of vLLM's CPU attention pages (K transposed
  per page, or as token rows for pages moved as tiles), and `copy_amx_blocks` whole blocks of
  its "amx" pages, for kvtier's connector inside vLLM (connector/vllm/layouts.py
  `VllmCpuLayout`, `VllmTileLayout`, `VllmAmxLayout`).

Every model family uses the layer kernels through `CausalLM.enable_cpu_ops` (engine/models/base.py).
There are no such kernels for other devices: callers keep PyTorch's ops there and wherever the kernels cannot be built.

The build (torch's C++ extension JIT, g++ with OpenMP: slow) happens once per source, torch
installation, flags and CPU, under `$KVTIER_HOME/torch_extensions/`: `make install` runs it
(`python -m engine.cpu_ops`), else the first model load does; processes that start together
wait on one build (a file lock the OS releases when its holder dies, so a build killed mid-way
never leaves the next load waiting). Without a compiler, `load()` returns None and says why
once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sysconfig
from pathlib import Path
from types import ModuleType

import torch

from engine.model_cache import file_lock, kvtier_home

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = [_CSRC / name for name in ("paged_decode_attention.cpp", "paged_prefill_attention.cpp", "fused_ops.cpp",
                                      "panel_linear.cpp", "kv_pages.cpp")]

# Built on the machine that runs it, so for its CPU; 512-bit vectors where it has them (gcc
# prefers 256 on some that do): markedly faster decode attention (docs/results.md).
_CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"]

# Keys per work item of the decode kernel: a long sequence is split so every thread works.
DECODE_PARTITION = 512


def _cpu_fingerprint() -> str:
    """The CPU's model and flags (the build uses -march=native)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _read_sources() -> dict[str, bytes]:
    """Returns engine/csrc's sources and headers by file name, in name order."""
    return {p.name: p.read_bytes() for p in sorted(_CSRC.iterdir()) if p.suffix in (".cpp", ".h")}


def _copy_sources(sources: dict[str, bytes], dest: Path) -> Path:
    """Returns `dest`, holding `sources` (engine/csrc). The build names its sources by path, so
    building from the checkout would make every other checkout (a fresh clone, CI) rebuild
    the same key; copies under the content-keyed build dir have one path for all of them."""
    dest.mkdir(exist_ok=True)
    for name, data in sources.items():
        target = dest / name
        if not target.exists() or target.read_bytes() != data:  # rewriting would bump the mtime
            tmp = dest / f".{name}.{os.getpid()}"
            tmp.write_bytes(data)
            os.replace(tmp, target)  # whole or absent for a process building at the same time
    return dest


@functools.cache
def load() -> ModuleType | None:
    """Returns the compiled kernels, building them on first use; None (logged once, with the
    reason) where they cannot be built."""
    sources = _read_sources()
    # The build file names the torch and Python headers it compiles against by path: two
    # environments with the same torch version (kvtier's and vLLM's) sharing one key rebuilt
    # it each time the other had built last.
    headers = [str(Path(torch.__file__).parent), sysconfig.get_paths()["include"]]
    key = hashlib.sha256(b"".join(sources.values()) + " ".join([torch.__version__, *headers, *_CFLAGS]).encode()
                         + _cpu_fingerprint().encode()).hexdigest()[:16]
    build_dir = kvtier_home() / "torch_extensions" / f"cpu_ops-{key}"
    try:
        from torch.utils.cpp_extension import load as build

        build_dir.mkdir(parents=True, exist_ok=True)
        with file_lock(build_dir / "build.flock"):
            # torch's own baton file outlives a build killed mid-way, and torch waits for it to
            # go forever; holding the lock above, any such file is a dead build's.
            (build_dir / "lock").unlink(missing_ok=True)
            sources_dir = _copy_sources(sources, build_dir / "src")
            return build(name="kvtier_cpu_ops", sources=[str(sources_dir / p.name) for p in _SOURCES],
                         build_directory=str(build_dir),
                         extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure means: use the PyTorch path
        logger.warning("kvtier's CPU kernels could not be built (%s: %s); decode attention uses the "
                       "PyTorch gather path", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


def paged_decode_attention(ops: ModuleType, q: torch.Tensor, kv_cache: torch.Tensor,
                           block_tables: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                           scale: float, softcap: float | None = None,
                           prior: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Returns `[B, Hq, D]` (q's dtype): each decode query `q` `[B, Hq, D]` attending over keys
    `starts[b]..lens[b] - 1` of its sequence, read in place from `kv_cache`'s blocks named by
    `block_tables` `[B, max_blocks]`, its scores `scale * q.k` capped to
    `softcap * tanh(scale * q.k / softcap)` when `softcap` is given. `prior`: (output
    `[B, Hq, D]`, log-sum-exp `[B, Hq]`, -inf where none), float32, of the same rows over
    other keys, merged in: the result is then the softmax over both. The cache is not modified."""
    prior_out, prior_lse = prior if prior is not None else (None, None)
    out = ops.paged_decode_attention(q.float().contiguous(), kv_cache, block_tables, starts, lens,
                                     scale, DECODE_PARTITION, softcap or 0.0, prior_out, prior_lse)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def paged_prefill_attention(ops: ModuleType, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            q_starts: torch.Tensor, q_lens: torch.Tensor, ctx_lens: torch.Tensor, scale: float,
                            softcap: float | None, out: torch.Tensor) -> None:
    """Writes into `out` `[T, Hq, D]` (float32, like `q`) the rows of each prefill s:
    `q_lens[s]` new tokens at rows `q_starts[s]`... of `q` and positions `ctx_lens[s]`...,
    each attending causally over its sequence's keys, read in place from `kv_cache`'s blocks
    named by `block_tables[s]` (their own K/V already written). Scores are `scale * q.k`,
    capped to `softcap * tanh(scale * q.k / softcap)` when `softcap` is given. Other rows of
    `out` and the cache are not modified."""
    if q.stride(-1) != 1 or q.stride(-2) != q.shape[-1]:
        q = q.contiguous()
    ops.paged_prefill_attention(q, kv_cache, block_tables, q_starts, q_lens, ctx_lens, scale, softcap or 0.0, out)


def paged_prefix_attention(ops: ModuleType, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           q_starts: torch.Tensor, q_lens: torch.Tensor, prefix_lens: torch.Tensor, scale: float,
                           softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (output `[T, Hq, D]`, log-sum-exp of scores `[T, Hq]`), float32, where the
    `q_lens[s]` rows of `q` `[T, Hq, D]` (float32) from `q_starts[s]` each attend the first
    `prefix_lens[s]` keys of `block_tables[s]`, not causally (scores as in
    `paged_prefill_attention`). Rows in no group are 0 with log-sum-exp -inf."""
    q = q.contiguous()
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"))
    ops.paged_prefix_attention(q, kv_cache, block_tables, q_starts, q_lens, prefix_lens, scale, softcap or 0.0,
                               out, lse)
    return out, lse


if __name__ == "__main__":  # `make install` builds the kernels here, not in the first request
    import sys

    built = load()
    print(f"kvtier CPU kernels: {built.__file__ if built is not None else 'not built (see the warning)'}")
    sys.exit(0 if built is not None else 1)
