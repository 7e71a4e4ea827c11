"""The cost of each form vLLM's CPU pages are moved in, in one run (ratios): a 4096-token load
of the default model's shape (30 layers, 3 KV heads of 64, bfloat16) in 256-token chunks into
and out of shuffled blocks of vLLM's CPU default size (128), through each layout of
connector/vllm/layouts.py:

- "vec" pages decoded by the compiled copy (`VllmCpuLayout`, engine/csrc/kv_pages.cpp);
- "amx" pages decoded block by block (`VllmAmxLayout`, whole blocks), by the compiled copy
  (engine/csrc/kv_pages.cpp `copy_amx_blocks`) and through PyTorch's views, and token by token
  (its path for a partial block, run here over every token to justify the block path);
- any pages moved as whole (block, KV head) tiles (`VllmTileLayout`), by the compiled copy and
  through PyTorch's views (its path where the kernels cannot be built, to justify the copy);
- and a plain copy of the same bytes (contiguous chunk to contiguous buffer), the floor.

What an AMX host stores ("auto": decoded, shared with every other engine and CPU; "tiles":
its own format) is chosen from these figures (docs/vllm.md, "CPU page layouts").

    .venv/bin/python -m benchmarks.bench_cpu_pages

Writes benchmarks/results/cpu_pages.json and cpu_pages.md.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_kernels import median_s
from connector.vllm.layouts import VllmAmxLayout, VllmCpuLayout, VllmTileLayout
from engine.kv_cache import PagedKVLayout

RESULTS = Path(__file__).resolve().parent / "results"
TILES = "tiles (any kernels), compiled copy"  # the row the others are given as ratios to
LAYERS, BLOCKS, BS, HKV, D, CHUNK, N = 30, 40, 128, 3, 64, 256, 4096


class _TokenByToken(VllmAmxLayout):
    """`VllmAmxLayout` moving every token by itself (its path for partial blocks)."""

    def _whole_blocks(self, slots: torch.Tensor) -> int:
        return 0


def main() -> int:
    torch.manual_seed(0)
    caches = [torch.randn(BLOCKS, HKV, BS, 2 * D).to(torch.bfloat16) for _ in range(LAYERS)]
    slots = (torch.randperm(BLOCKS)[:N // BS].unsqueeze(1) * BS + torch.arange(BS)).flatten().split(CHUNK)
    chunks = [torch.randn(LAYERS, 2, CHUNK, HKV, D).to(torch.bfloat16) for _ in slots]
    layouts: dict[str, PagedKVLayout] = {
        "vec, decoded (compiled copy)": VllmCpuLayout(caches),
        "amx, decoded block by block (compiled copy)": VllmAmxLayout(caches),
        "amx, decoded block by block through PyTorch's views": VllmAmxLayout(caches, kernels=False),
        "amx, decoded token by token": _TokenByToken(caches),
        "tiles, through PyTorch's views": VllmTileLayout(caches, kernels=False),
        TILES: VllmTileLayout(caches)}
    reps = 7
    rows: list[dict[str, Any]] = []
    for name, layout in layouts.items():
        scatter = median_s(lambda lay=layout: [lay.scatter_chunk(s, c) for s, c in zip(slots, chunks)], reps)
        gather = median_s(lambda lay=layout: [lay.gather_chunk(s) for s in slots], reps)
        rows.append({"layout": name, "scatter_s": scatter, "gather_s": gather})
        print(f"{name}: scatter {scatter * 1e3:.1f} ms, gather {gather * 1e3:.1f} ms", file=sys.stderr)
    flat = [torch.empty_like(c) for c in chunks]
    plain = median_s(lambda: [f.copy_(c) for f, c in zip(flat, chunks)], reps)
    rows.append({"layout": "a plain copy of the same bytes", "scatter_s": plain, "gather_s": plain})
    tiles = next(r for r in rows if r["layout"] == TILES)
    nbytes = sum(c.numel() * 2 for c in chunks)
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = "AMX" if " amx_tile" in flags else "AVX-512" if " avx512f" in flags else "AVX2"
    res = {"platform": platform.platform(), "cpu": cpu, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "tokens": N, "chunk": CHUNK, "block_size": BS, "bytes": nbytes, "reps": reps, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_pages.json").write_text(json.dumps(res, indent=2) + "\n")
    lines = [f"vLLM CPU pages, a {N}-token load in {CHUNK}-token chunks of {LAYERS} layers, bfloat16, block size "
             f"{BS} ({nbytes / 1e6:.0f} MB each way; {cpu}, torch {res['torch']}, {res['threads']} threads; medians "
             f"of {reps})", "",
             "| layout | scatter (load) | / tiles | gather (store) | / tiles |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['layout']} | {r['scatter_s'] * 1e3:.1f} ms | {r['scatter_s'] / tiles['scatter_s']:.2f}x | "
              f"{r['gather_s'] * 1e3:.1f} ms | {r['gather_s'] / tiles['gather_s']:.2f}x |" for r in rows]
    table = "\n".join(lines) + "\n"
    (RESULTS / "cpu_pages.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
