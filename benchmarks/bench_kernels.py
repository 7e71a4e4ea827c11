"""The engine's CPU fast paths against the PyTorch ops they replace, in one run (ratios).

- linear layers: every linear of the default model's 30 layers (fp32 weights, 425 MB, so
  they stream from memory as in a real step) at 1, 4, 16, 64, 512 and 2048 rows: `F.linear`
  (MKL), oneDNN with prepacked weights, and kvtier's panel kernel (engine/linear_backend.py);
- decode attention, one layer: the gather + SDPA path against the compiled kernel that reads
  the blocks in place (engine/cpu_ops.py), at batch 1, 16, 64 and contexts 1k and 4k, each
  sequence on its own blocks;
- prefill attention, one layer: PyTorch's SDPA path (flash for a fresh prompt; padded or
  masked over cached context) against the tiled kernel that reads the blocks in place, for
  fresh prompts of 1k and 4k tokens and new tokens over cached context;
- decode rows sharing a prefix, one layer: every row reading the prefix itself (the decode
  kernel) against the cascade (engine/cascade_attention.py: the prefix once for all rows);
- vLLM CPU pages (K transposed per block), a 4096-token load's 256-token chunks of the
  default model's 30 layers into and out of shuffled blocks: PyTorch's indexing through views
  against the compiled copy (connector/vllm/layouts.py).

    .venv/bin/python -m benchmarks.bench_kernels [--quick]

Writes benchmarks/results/kernels.json and kernels.md (`--quick`: kernels_quick.*).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.bench_engine import median_time
from engine import cpu_ops
from engine.attention_metadata import AttentionMetadata
from engine.kv_cache import slot_mapping
from engine.linear_backend import PackedLinear, PanelLinear
from engine.paged_attention import build_plan, paged_attention

REPO = Path(__file__).resolve().parents[1]

RESULTS = REPO / "benchmarks" / "results"
# SmolLM2-135M: hidden 576, 9 query / 3 kv heads of 64, MLP 1536, 30 layers.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def median_s(fn: Callable[[], Any], reps: int) -> float:
    """bench_engine's median of `reps` timed calls, after one untimed call (first-shape costs)."""
    fn()
    return median_time(fn, reps)


def bench_linear(ops: ModuleType, rows: list[int], layers: int, reps: int) -> list[dict[str, Any]]:
    weights = [[torch.randn(o, i) * 0.02 for o, i in LAYER_SHAPES] for _ in range(layers)]
    packed = [[PackedLinear(w, None) for w in layer] for layer in weights]
    panels = [[PanelLinear(w, None, ops) for w in layer] for layer in weights]
    weight_bytes = sum(w.numel() * 4 for layer in weights for w in layer)
    out = []
    for m in rows:
        xs = {i: torch.randn(m, i) for _, i in LAYER_SHAPES}
        plain = median_s(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for layer in weights for w in layer], reps)
        onednn = median_s(lambda xs=xs: [p(xs[p.in_features]) for layer in packed for p in layer], reps)
        panel = median_s(lambda xs=xs: [p(xs[p.in_features]) for layer in panels for p in layer], reps)
        out.append({"rows": m, "torch_s": plain, "onednn_s": onednn, "panel_s": panel, "speedup": plain / onednn,
                    "panel_speedup": onednn / panel, "panel_GBps": weight_bytes / panel / 1e9,
                    "panel_GFLOPs": 2 * m * weight_bytes / 4 / panel / 1e9})
        print(f"linear {m} rows: F.linear {plain * 1e3:.1f} ms, oneDNN {onednn * 1e3:.1f} ms, "
              f"panels {panel * 1e3:.1f} ms", file=sys.stderr)
    return out


def load_ops() -> ModuleType:
    """Returns the built kernels, or exits saying why there are none."""
    ops = cpu_ops.load()
    if ops is None:
        raise SystemExit("engine/csrc did not build: see the warning above")
    return ops


def bench_decode(cells: list[tuple[int, int]], reps: int) -> list[dict[str, Any]]:
    ops = load_ops()
    bs, hq, hkv, d = 16, 9, 3, 64
    out = []
    for batch, ctx in cells:
        per_seq = ctx // bs
        kv = torch.randn(2, batch * per_seq + 1, bs, hkv, d)
        tables = torch.randperm(batch * per_seq).view(batch, per_seq)
        meta = AttentionMetadata(slot_mapping=torch.zeros(batch, dtype=torch.long), block_tables=tables,
                                 query_start_loc=list(range(batch + 1)), seq_lens=[ctx] * batch, block_size=bs)
        q, k, v = torch.randn(batch, hq, d), torch.randn(batch, hkv, d), torch.randn(batch, hkv, d)
        gather_plan, kernel_plan = build_plan(meta, torch.device("cpu")), build_plan(meta, torch.device("cpu"),
                                                                                     cpu_ops=ops)
        args = (q, k, v, kv)
        gather = median_s(lambda a=args, p=gather_plan: paged_attention(*a, p, 0.125), reps)
        kernel = median_s(lambda a=args, p=kernel_plan: paged_attention(*a, p, 0.125), reps)
        kv_bytes = batch * ctx * hkv * d * 2 * 4
        out.append({"batch": batch, "context": ctx, "gather_s": gather, "kernel_s": kernel,
                    "speedup": gather / kernel, "kernel_GBps": kv_bytes / kernel / 1e9})
        print(f"decode attention {batch}x{ctx}: gather {gather * 1e3:.2f} ms, kernel {kernel * 1e3:.2f} ms",
              file=sys.stderr)
    return out


def bench_prefill(cells: list[tuple[int, int, int]], reps: int) -> list[dict[str, Any]]:
    """Cells: (sequences, cached context, new tokens each), each sequence on its own blocks."""
    ops = load_ops()
    bs, hq, hkv, d = 16, 9, 3, 64
    out = []
    for batch, ctx, new in cells:
        per_seq = -(-(ctx + new) // bs)
        kv = torch.randn(2, batch * per_seq + 1, bs, hkv, d)
        tables = torch.randperm(batch * per_seq).view(batch, per_seq)
        seq_index = torch.arange(batch).repeat_interleave(new)
        slots = slot_mapping(tables, seq_index, torch.arange(ctx, ctx + new).repeat(batch), bs)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables,
                                 query_start_loc=[b * new for b in range(batch + 1)],
                                 seq_lens=[ctx + new] * batch, block_size=bs)
        q = torch.randn(batch * new, hq, d)
        k, v = kv.flatten(1, 2)[:, slots]  # the new tokens' K/V, as written to the cache
        torch_plan, kernel_plan = build_plan(meta, torch.device("cpu")), build_plan(meta, torch.device("cpu"),
                                                                                    cpu_ops=ops)
        assert kernel_plan.tiled_ops is not None  # the kernel is what is measured
        args = (q, k, v, kv)
        plain = median_s(lambda a=args, p=torch_plan: paged_attention(*a, p, 0.125), reps)
        kernel = median_s(lambda a=args, p=kernel_plan: paged_attention(*a, p, 0.125), reps)
        flops = 4 * batch * hq * d * (new * ctx + new * (new + 1) / 2)  # q.k and p.v, causal
        out.append({"batch": batch, "context": ctx, "new": new, "torch_s": plain, "kernel_s": kernel,
                    "speedup": plain / kernel, "kernel_GFLOPs": flops / kernel / 1e9})
        print(f"prefill attention {batch}x({ctx} + {new}): SDPA path {plain * 1e3:.2f} ms, "
              f"kernel {kernel * 1e3:.2f} ms", file=sys.stderr)
    return out


def bench_shared_decode(cells: list[tuple[int, int]], reps: int) -> list[dict[str, Any]]:
    """Cells: (rows, shared prefix); each row also has 64 keys of its own, on its own blocks."""
    ops = load_ops()
    bs, hq, hkv, d, own = 16, 9, 3, 64, 64
    out = []
    for batch, prefix in cells:
        shared, mine = prefix // bs, own // bs
        blocks = torch.randperm(shared + batch * mine)
        tables = torch.cat([blocks[:shared].expand(batch, shared), blocks[shared:].view(batch, mine)], dim=1)
        kv = torch.randn(2, len(blocks), bs, hkv, d)
        lens = [prefix + own] * batch
        slots = slot_mapping(tables, torch.arange(batch), torch.tensor(lens) - 1, bs)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, query_start_loc=list(range(batch + 1)),
                                 seq_lens=lens, block_size=bs)
        q = torch.randn(batch, hq, d)
        k, v = kv.flatten(1, 2)[:, slots]
        cascade_plan = build_plan(meta, torch.device("cpu"), cpu_ops=ops)
        rows_plan = build_plan(meta, torch.device("cpu"), cpu_ops=ops)
        assert cascade_plan.decode_shared is not None and rows_plan.decode_starts is not None
        rows_plan.decode_shared, rows_plan.decode_starts = None, torch.zeros_like(rows_plan.decode_starts)
        args = (q, k, v, kv)
        rows = median_s(lambda a=args, p=rows_plan: paged_attention(*a, p, 0.125), reps)
        cascade = median_s(lambda a=args, p=cascade_plan: paged_attention(*a, p, 0.125), reps)
        out.append({"batch": batch, "prefix": prefix, "own": own, "rows_s": rows, "cascade_s": cascade,
                    "speedup": rows / cascade})
        print(f"shared-prefix decode {batch}x{prefix}: rows {rows * 1e3:.2f} ms, cascade {cascade * 1e3:.2f} ms",
              file=sys.stderr)
    return out


def bench_vllm_pages(reps: int) -> dict[str, Any]:
    """A 4096-token load's chunks (256 tokens, 30 layers) into and out of shuffled blocks:
    188 MB each way, out of cache as in a real load."""
    from connector.vllm.layouts import VllmCpuLayout

    layers, blocks, bs, hkv, d, chunk, n = 30, 512, 16, 3, 64, 256, 4096
    caches = [torch.randn(blocks, hkv, bs, 2 * d) for _ in range(layers)]
    fast, views = VllmCpuLayout(caches), VllmCpuLayout(caches, kernels=False)
    assert fast._ops is not None, "engine/csrc did not build: see the warning above"
    slots = (torch.randperm(blocks)[:n // bs].unsqueeze(1) * bs + torch.arange(bs)).flatten().split(chunk)
    chunks = [torch.randn(layers, 2, chunk, hkv, d) for _ in slots]
    res: dict[str, Any] = {"tokens": n, "chunk": chunk, "bytes": sum(c.numel() * 4 for c in chunks)}
    for name, layout in (("views", views), ("kernel", fast)):
        res[f"{name}_scatter_s"] = median_s(
            lambda lay=layout: [lay.scatter_chunk(s, c) for s, c in zip(slots, chunks)], reps)
        res[f"{name}_gather_s"] = median_s(lambda lay=layout: [lay.gather_chunk(s) for s in slots], reps)
    print(f"vLLM CPU pages: scatter {res['views_scatter_s'] * 1e3:.2f} -> {res['kernel_scatter_s'] * 1e3:.2f} ms",
          file=sys.stderr)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        rows, layers, cells, reps = [1, 16], 2, [(1, 256), (4, 256)], 3
        prefills = [(1, 0, 300), (2, 200, 40)]
        shared = [(8, 1024)]
    else:
        rows, layers, reps = [1, 4, 16, 64, 512, 2048], 30, 7
        cells = [(b, c) for c in (1024, 4096) for b in (1, 16, 64)]
        prefills = [(1, 0, 1024), (1, 0, 4096), (1, 2048, 16), (16, 1024, 64), (4, 1024, 256)]
        shared = [(b, p) for p in (1024, 4096) for b in (8, 16, 64)]
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    isa = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else platform.machine()
    res = {"quick": args.quick, "platform": platform.platform(), "isa": isa, "torch": torch.__version__,
           "threads": torch.get_num_threads(), "linear": bench_linear(load_ops(), rows, layers, reps),
           "decode_attention": bench_decode(cells, reps), "prefill_attention": bench_prefill(prefills, reps),
           "shared_prefix_decode": bench_shared_decode(shared, reps), "vllm_cpu_pages": bench_vllm_pages(reps)}
    suffix = "_quick" if args.quick else ""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"kernels{suffix}.json").write_text(json.dumps(res, indent=2) + "\n")
    lines = [f"CPU fast paths vs the PyTorch ops they replace ({isa}, torch {res['torch']}, {res['threads']} threads; "
             f"medians of {reps})", "",
             f"| linear layers ({layers} layers of SmolLM2-135M, fp32) | F.linear (MKL) | oneDNN prepacked | "
             "speedup | panel kernel | panels / oneDNN | panels read / compute |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['rows']} rows | {r['torch_s'] * 1e3:.1f} ms | {r['onednn_s'] * 1e3:.1f} ms | "
              f"**{r['speedup']:.2f}x** | {r['panel_s'] * 1e3:.1f} ms | **{r['panel_speedup']:.2f}x** | "
              f"{r['panel_GBps']:.1f} GB/s, {r['panel_GFLOPs']:.0f} GFLOP/s |" for r in res["linear"]]
    lines += ["", "| decode attention, one layer (9 q / 3 kv heads of 64) | gather + SDPA | in-place kernel | "
              "speedup | kernel's K/V read rate |", "|---|---:|---:|---:|---:|"]
    lines += [f"| batch {r['batch']}, context {r['context']} | {r['gather_s'] * 1e3:.2f} ms | "
              f"{r['kernel_s'] * 1e3:.2f} ms | **{r['speedup']:.2f}x** | {r['kernel_GBps']:.1f} GB/s |"
              for r in res["decode_attention"]]
    lines += ["", "| prefill attention, one layer (9 q / 3 kv heads of 64) | PyTorch SDPA path | tiled kernel | "
              "speedup | kernel |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} x {r['new']} new tokens over {r['context']} cached | {r['torch_s'] * 1e3:.2f} ms | "
              f"{r['kernel_s'] * 1e3:.2f} ms | **{r['speedup']:.2f}x** | {r['kernel_GFLOPs']:.0f} GFLOP/s |"
              for r in res["prefill_attention"]]
    lines += ["", "| decode rows sharing a prefix, one layer (64 keys of their own each) | each row reads it | "
              "cascade | speedup |", "|---|---:|---:|---:|"]
    lines += [f"| {r['batch']} rows over {r['prefix']} shared keys | {r['rows_s'] * 1e3:.2f} ms | "
              f"{r['cascade_s'] * 1e3:.2f} ms | **{r['speedup']:.2f}x** |" for r in res["shared_prefix_decode"]]
    pg = res["vllm_cpu_pages"]
    lines += ["", f"| vLLM CPU pages, a {pg['tokens']}-token load in {pg['chunk']}-token chunks of 30 layers "
              f"({pg['bytes'] / 1e6:.0f} MB) | PyTorch views | compiled copy | speedup |", "|---|---:|---:|---:|"]
    lines += [f"| {op} | {pg[f'views_{op}_s'] * 1e3:.2f} ms | {pg[f'kernel_{op}_s'] * 1e3:.2f} ms | "
              f"**{pg[f'views_{op}_s'] / pg[f'kernel_{op}_s']:.2f}x** |" for op in ("scatter", "gather")]
    table = "\n".join(lines) + "\n"
    (RESULTS / f"kernels{suffix}.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
