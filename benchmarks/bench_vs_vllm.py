"""kvtier's engine against vLLM's CPU build on the same machine, side by side in one invocation.

Both engines get the same token-id prompts, one after the other, each in its own process with
the same interpreter (vLLM at its best here: `enforce_eager`, both cores bound, Intel OpenMP
preloaded when its environment ships it, TCMalloc preloaded as its CPU docs advise when the
machine has it (Debian: `apt-get install libtcmalloc-minimal4`; ~1.1-1.3x its prefill), prefix
caching on; kvtier as installed, its default `kernels="auto"`), fp32 (or `--dtype bfloat16`:
both engines in bfloat16, and the kernels vLLM's CPU attention picks for it here, "amx" on a
Xeon with AMX tiles, are named), greedy, the same `max_num_seqs` (64) and
`max_num_batched_tokens` (4096):

- decode tokens/s at batch 1, 16, 64 and contexts of 64, 1k, 4k tokens: `B * N / (t(N+1) -
  t(1))`, where t(m) is the wall time of generating m tokens for the B prompts (their prefill is
  the same prefix-cache hit in both runs, so the difference is N decode steps). Contexts of 1k
  and 4k share all but their last 64 tokens (one document, B questions): both prefix caches
  compute it once, and every sequence's attention still reads its whole context. Each
  context is a round: a process of each engine runs its three cells, one right after the
  other, the first engine alternating between rounds, so both see the host as it is then (a
  shared VM's speed drifts by 10-20% over the minutes a whole grid takes);
- prefill tokens/s of a fresh 1k and 4k prompt (max_tokens 1), in `PREFILL_ROUNDS` rounds like
  those (medians of `--reps` prompts per process). The row gives each engine's median over the
  rounds, the median of the rounds' ratios, and all of them;
- TTFT of a 2048-token prompt seen before (engine prefix cache), kvtier at block 16, vLLM at
  block 32, 64 and 128 (its CPU default; it refuses blocks that are not multiples of 32);
- greedy tokens of 7 prompts x 32 from both, compared;
- two physical bounds per decode cell, measured here in this run (before and after the arms,
  the better of the two): bytes a step must read
  (weights + the K/V it attends over) / memory bandwidth (`sum` of 1 GiB), and FLOPs a step
  must do / fp32 GEMM throughput (a 2048x576 by 576x3072 product, the faster of MKL and
  oneDNN); each engine's tokens/s as a percentage of the lower bound's tokens/s. (With a
  shared document the K/V a step reads mostly comes from cache, so the bytes bound is loose.)

    make bench-vs-vllm   (= .venv-vllm/bin/python -m benchmarks.bench_vs_vllm [--quick] [--reps N])
    make bench-vs-vllm BENCH_ARGS="--dtype bfloat16 --cells 16x64,8x1024 --prefill 1024"

Writes benchmarks/results/vs_vllm.json and vs_vllm.md (`--quick`: vs_vllm_quick.*, small sizes
that only check the script runs; `--cells`: vs_vllm_cells.*; in bfloat16, `_bfloat16` after
the name). Exits non-zero with a message if vLLM cannot be imported:
it never runs one arm alone.
"""

from __future__ import annotations

import argparse
import ctypes.util
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import process

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
NEW_TOKENS = 32  # decode steps timed per cell
PREFILL_ROUNDS = 3  # rounds of (kvtier, vLLM) prefill processes
SUFFIX = 64  # distinct tail of each prompt in a long-context decode cell


def token_ids(n: int, salt: int) -> list[int]:
    """Deterministic, varied token ids (no tokenizer round trip)."""
    return [(i * 7919 + salt * 104729 + 13) % 40000 + 100 for i in range(n)]


def decode_prompts(batch: int, ctx: int) -> list[list[int]]:
    """`batch` prompts of `ctx` tokens: distinct at ctx <= SUFFIX, else one shared document of
    ctx - SUFFIX tokens followed by a distinct SUFFIX-token tail."""
    if ctx <= SUFFIX:
        return [token_ids(ctx, 10_000 + ctx + b) for b in range(batch)]
    doc = token_ids(ctx - SUFFIX, 20_000 + ctx)
    return [doc + token_ids(SUFFIX, 30_000 + ctx + b) for b in range(batch)]


# ---- the child: one engine ---------------------------------------------------------------
class _Engine:
    """`generate(prompts, max_tokens) -> token ids per prompt` over either engine, greedy."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.kind = spec["engine"]
        common = {"max_num_seqs": 64, "max_num_batched_tokens": 4096, "block_size": spec["block_size"]}
        if self.kind == "vllm":
            from vllm import LLM, SamplingParams

            self.llm: Any = LLM(model=spec["model"], dtype=spec["dtype"], enforce_eager=True, max_model_len=4608,
                                enable_prefix_caching=True, seed=0, **common)
        else:
            from engine import LLM, SamplingParams  # type: ignore[assignment]

            self.llm = LLM(spec["model"], dtype=spec["dtype"], max_model_len=4608,
                           kv_cache_memory_bytes=spec["kv_gib"] << 30, **common)
        self.params = SamplingParams

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        sp = self.params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        if self.kind == "vllm":
            from vllm import TokensPrompt

            outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        else:
            outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        return [list(o.outputs[0].token_ids) for o in outs]

    def timed(self, prompts: list[list[int]], max_tokens: int) -> float:
        t0 = time.perf_counter()
        self.generate(prompts, max_tokens)
        return time.perf_counter() - t0


def child(spec: dict[str, Any]) -> dict[str, Any]:
    eng = _Engine(spec)
    reps = spec["reps"]
    eng.generate([token_ids(64, 1)], 2)  # first-call costs out of the figures
    out: dict[str, Any] = {"decode": {}, "prefill": {}, "ttft": {}}
    if spec["engine"] == "vllm":  # the kernels its CPU attention runs here
        import torch
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        out["attention_isa"] = str(_get_attn_isa(getattr(torch, spec["dtype"]), spec["block_size"], 64))
    for batch, ctx in spec["decode"]:
        prompts = decode_prompts(batch, ctx)
        eng.generate(prompts, NEW_TOKENS + 1)  # prefix cache filled, shapes warm
        rates = []
        for _ in range(reps):
            t1 = eng.timed(prompts, 1)
            tn = eng.timed(prompts, NEW_TOKENS + 1)
            rates.append(batch * NEW_TOKENS / (tn - t1))
        out["decode"][f"{batch}x{ctx}"] = statistics.median(rates)
        print(f"{spec['engine']} decode {batch}x{ctx}: {out['decode'][f'{batch}x{ctx}']:.1f} tok/s",
              file=sys.stderr, flush=True)
    for n in spec["prefill"]:
        eng.timed([token_ids(n, 40_000 + n)], 1)  # this shape warm
        times = [eng.timed([token_ids(n, 41_000 + n + r)], 1) for r in range(reps)]
        out["prefill"][str(n)] = n / statistics.median(times)
    if spec["ttft"]:
        n = spec["ttft"]
        warm = []
        for r in range(reps):
            ids = token_ids(n, 50_000 + r)
            eng.timed([ids], 1)
            warm.append(eng.timed([ids], 1))
        out["ttft"][str(n)] = statistics.median(warm)
    if spec["greedy"]:
        out["greedy"] = eng.generate([token_ids(16 + 8 * i, 60_000 + i) for i in range(7)], 32)
    return out


# ---- the parent: bounds, then both engines -----------------------------------------------
def cpu_features() -> str:
    """Returns the vector extensions of this CPU that pick kernels: AMX tiles, AVX512-BF16, AVX-512, AVX2."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    return ", ".join(f for f in ("amx_tile", "avx512_bf16", "avx512f", "avx2") if f in flags) or platform.machine()


def measure_machine() -> dict[str, float]:
    """Memory read bandwidth (bytes/s, best of 5 `sum`s of 1 GiB) and fp32 GEMM FLOP/s (best of
    10 2048x576 by 576x3072 products, on MKL and on oneDNN, whichever is faster), with this
    process's torch and threads."""
    import torch

    from engine.linear_backend import PackedLinear

    x = torch.ones(256 << 20)
    bw = []
    for _ in range(6):
        t0 = time.perf_counter()
        x.sum()
        bw.append(x.numel() * 4 / (time.perf_counter() - t0))
    a, w = torch.randn(2048, 576), torch.randn(3072, 576)
    packed = PackedLinear(w, None)
    gemm = []
    for fn in (lambda: a @ w.t(), lambda: packed(a)):
        for i in range(11):
            t0 = time.perf_counter()
            fn()
            if i:  # the first call sets up
                gemm.append(2 * 2048 * 576 * 3072 / (time.perf_counter() - t0))
    return {"bandwidth_Bps": max(bw[1:]), "gemm_flops": max(gemm)}


def step_bounds(cfg: dict[str, Any], batch: int, ctx: int, machine: dict[str, float]) -> dict[str, float]:
    """Decode tokens/s if a step only read its bytes at the measured bandwidth, or only did its
    FLOPs at the measured GEMM rate (fp32 weights; logits for the batch's last tokens only)."""
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    linear = layers * (h * (q + 2 * kv) + q * h + 3 * h * i) + h * cfg["vocab_size"]
    kv_read = batch * ctx * layers * 2 * kv * 4
    step_bytes = linear * 4 + kv_read
    step_flops = 2 * batch * linear + 4 * batch * ctx * layers * q
    return {"bytes_tok_s": batch * machine["bandwidth_Bps"] / step_bytes,
            "gemm_tok_s": batch * machine["gemm_flops"] / step_flops}


def vllm_preloads() -> list[str]:
    """Returns the libraries vLLM's CPU docs preload that this machine has: TCMalloc (from the
    system) and Intel OpenMP (from vLLM's environment)."""
    found = [ctypes.util.find_library("tcmalloc_minimal") or "", str(Path(sys.prefix) / "lib" / "libiomp5.so")]
    paths = []
    for name in found:
        if name and not os.path.isabs(name):  # find_library gives a soname: the loader's path for it
            name = next((str(d / name) for d in (Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"),
                                                  Path("/usr/lib")) if (d / name).exists()), "")
        if name and Path(name).exists():
            paths.append(name)
    return paths


def run_arm(name: str, spec: dict[str, Any], log_dir: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec["kv_gib"]))
    if spec["engine"] == "vllm":  # vLLM's CPU docs' setup; kvtier runs as installed
        env.setdefault("LD_PRELOAD", ":".join(vllm_preloads()))
    log = log_dir / f"{name}.log"
    result = log.with_suffix(".json")
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = process.run([sys.executable, "-m", "benchmarks.bench_vs_vllm", "--child",
                            json.dumps({**spec, "out": str(result)})],
                           cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=5400)
    if proc.returncode or not result.exists():
        tail = log.read_text(errors="replace").splitlines()[-5:]
        raise SystemExit(f"arm {name} failed (exit {proc.returncode}); log {log}:\n" + "\n".join(tail))
    out: dict[str, Any] = json.loads(result.read_text())
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def paired_round(i: int, label: str, arms: dict[str, Any], rows: dict[str, Any], log_dir: Path) -> dict[str, Any]:
    """Returns one round's results per engine: a process of each engine measuring only `rows`
    (the spec's "decode" and/or "prefill"), one right after the other, kvtier first in even
    rounds and vLLM first in odd ones."""
    order = ["kvtier", "vllm"] if i % 2 == 0 else ["vllm", "kvtier"]
    out = {}
    for name in order:
        print(f"{label} round {i + 1}: {name} ...", file=sys.stderr, flush=True)
        spec = {**arms[name], "decode": [], "prefill": [], "ttft": 0, "greedy": False, **rows}
        out[name] = run_arm(f"{name}_{label}{i + 1}", spec, log_dir)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cells", help="only these decode cells, e.g. 16x64,64x1024, and no other row "
                    "(a quick look; writes vs_vllm_cells.*)")
    ap.add_argument("--prefill", help="with --cells, also these fresh prompt lengths, e.g. 1024")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="both engines' weights and K/V dtype (default: float32)")
    args = ap.parse_args()
    if args.child:  # the result goes to a file: vLLM's processes share this one's stdout
        spec = json.loads(args.child)
        Path(spec["out"]).write_text(json.dumps(child(spec)))
        return 0
    if importlib.util.find_spec("vllm") is None:
        print(f"vLLM is not importable from {sys.executable}: run `make vllm-install` and this script with "
              ".venv-vllm/bin/python (`make bench-vs-vllm`). Not running kvtier's arm alone.", file=sys.stderr)
        return 2

    from engine.default_model import ensure_default_model

    model = str(ensure_default_model())
    cfg = json.loads((Path(model) / "config.json").read_text())
    machine = measure_machine()
    if args.quick:
        decode, prefill, ttft, reps = [(1, 64), (4, 256)], [256], 512, 1
    else:
        decode = [(b, c) for c in (64, 1024, 4096) for b in (1, 16, 64)]
        prefill, ttft, reps = [1024, 4096], 2048, args.reps
    if args.cells:
        decode = [(int(b), int(c)) for b, c in (cell.split("x") for cell in args.cells.split(","))]
        prefill, ttft = [int(n) for n in args.prefill.split(",")] if args.prefill else [], 0
    base = {"model": model, "reps": reps, "kv_gib": 4, "dtype": args.dtype}
    arms = {
        "kvtier": {**base, "engine": "kvtier", "block_size": 16, "decode": [], "prefill": [],
                   "ttft": ttft, "greedy": True},
        "vllm": {**base, "engine": "vllm", "block_size": 128, "decode": [], "prefill": [],
                 "ttft": ttft, "greedy": True},
    }
    if ttft:
        for bs in (32, 64):
            arms[f"vllm_block{bs}"] = {**base, "engine": "vllm", "block_size": bs, "decode": [], "prefill": [],
                                       "ttft": ttft, "greedy": False}
    if not any("tcmalloc" in p for p in vllm_preloads()):
        print("TCMalloc not found: vLLM runs on glibc's malloc, ~10-25% slower prefill than with the allocator "
              "its CPU docs advise (apt-get install libtcmalloc-minimal4)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-vs-vllm-"))
    res: dict[str, Any] = {"quick": args.quick, "platform": platform.platform(), "reps": reps, "dtype": args.dtype,
                           "cpu": cpu_features(),
                           "new_tokens": NEW_TOKENS, "machine": machine,
                           "env": {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD")},
                           "vllm_preloads": vllm_preloads()}
    for name, spec in arms.items():
        print(f"arm {name} ...", file=sys.stderr, flush=True)
        res[name] = run_arm(name, spec, tmp)
    for i, ctx in enumerate(sorted({c for _, c in decode})):  # a context's cells: one round
        cells = [(b, c) for b, c in decode if c == ctx]
        for name, arm in paired_round(i, f"decode{ctx}", arms, {"decode": cells}, tmp).items():
            res[name]["decode"].update(arm["decode"])
    rounds = 0 if not prefill else 1 if args.quick else PREFILL_ROUNDS
    res["prefill_rounds"] = [{name: arm["prefill"] for name, arm in
                              paired_round(i, "prefill", arms, {"prefill": prefill}, tmp).items()}
                             for i in range(rounds)]
    after = measure_machine()  # the machine's best of both, in case one was disturbed
    res["machine"] = machine = {k: max(v, after[k]) for k, v in machine.items()}
    res["bounds"] = {f"{b}x{c}": step_bounds(cfg, b, c, machine) for b, c in decode}
    suffix = ("_quick" if args.quick else "_cells" if args.cells else "") + (
        "" if args.dtype == "float32" else f"_{args.dtype}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"vs_vllm{suffix}.json").write_text(json.dumps(res, indent=2) + "\n")
    table = render(res)
    (RESULTS / f"vs_vllm{suffix}.md").write_text(table)
    print(table)
    return 0


def render(res: dict[str, Any]) -> str:
    k, v = res["kvtier"], res["vllm"]
    m = res["machine"]
    isa = v.get("attention_isa")
    lines = [f"Both engines in {res.get('dtype', 'float32')}"
             + (f"; vLLM's CPU attention runs its {isa!r} kernels" if isa else "")
             + (f"; CPU: {res['cpu']}" if res.get("cpu") else "") + ".",
             f"Machine, measured in this run: memory read {m['bandwidth_Bps'] / 1e9:.1f} GB/s, "
             f"fp32 GEMM {m['gemm_flops'] / 1e9:.0f} GFLOP/s. Decode: {res['new_tokens']} new tokens per "
             f"sequence, medians of {res['reps']}. vLLM preloads: "
             f"{', '.join(Path(p).name for p in res.get('vllm_preloads', [])) or 'none'}.", "",
             "| figure | kvtier | vLLM CPU | kvtier / vLLM | bound (bytes; FLOPs) | kvtier, vLLM % of bound |",
             "|---|---:|---:|---:|---:|---:|"]
    for cell, kt in k["decode"].items():
        vt = v["decode"][cell]
        bd = res["bounds"][cell]
        best = min(bd["bytes_tok_s"], bd["gemm_tok_s"])
        b, c = cell.split("x")
        lines.append(f"| decode tok/s, batch {b}, context {c} | {kt:.1f} | {vt:.1f} | **{kt / vt:.2f}x** | "
                     f"{bd['bytes_tok_s']:.0f}; {bd['gemm_tok_s']:.0f} | "
                     f"{100 * kt / best:.0f}%, {100 * vt / best:.0f}% |")
    rounds = res.get("prefill_rounds", [])
    for n in rounds[0]["kvtier"] if rounds else []:
        kts, vts = [r["kvtier"][n] for r in rounds], [r["vllm"][n] for r in rounds]
        ratios = [kt / vt for kt, vt in zip(kts, vts)]
        runs = f"{len(rounds)} round{'s' * (len(rounds) > 1)}"
        lines.append(f"| prefill tok/s, {n} tokens, {runs} | {statistics.median(kts):.0f} | "
                     f"{statistics.median(vts):.0f} | **{statistics.median(ratios):.2f}x** (rounds: "
                     f"{', '.join(f'{r:.2f}' for r in ratios)}) | | |")
    for n, kt in k.get("ttft", {}).items():
        vllm_ttft = {bs: res[a]["ttft"][n] for bs, a in ((32, "vllm_block32"), (64, "vllm_block64"), (128, "vllm"))
                     if a in res}
        best_bs = min(vllm_ttft, key=lambda bs: vllm_ttft[bs])
        per_bs = ", ".join(f"{t * 1e3:.0f} ms (block {bs})" for bs, t in vllm_ttft.items())
        lines.append(f"| warm TTFT, {n}-token prompt again (prefix cache) | {kt * 1e3:.0f} ms (block 16) | "
                     f"{per_bs} | **{kt / vllm_ttft[best_bs]:.2f}x** of its best | | |")
    if "greedy" in k and "greedy" in v:
        same = sum(a == b for a, b in zip(k["greedy"], v["greedy"]))
        lines.append(f"| greedy tokens, {len(k['greedy'])} prompts x 32 | {same} of {len(k['greedy'])} "
                     "identical to vLLM's | | | | |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
