"""`kvtier serve` against `vllm serve` + kvtier's connector, measured by vLLM's own client.

One run, one server at a time on the same machine and flags: `kvtier serve` (kvtier's
environment, .venv) with a `cpu` tier, then `vllm serve` (vLLM's CPU build, .venv-vllm, started
as `kvtier-vllm serve`) with KVTierConnector and a `cpu` tier. Both: fp32, prefix caching on,
2 GiB of KV cache, max_num_seqs 64, max_num_batched_tokens 2048, max_model_len 4096; vLLM
eager, both cores bound, Intel OpenMP preloaded when its environment ships it (as in
bench_vs_vllm). Against each, `vllm bench serve` (vLLM's benchmark client, run from .venv-vllm
through `kvtier-vllm bench serve`) runs two workloads with the same seed, prompts and Poisson
request rate, streaming /v1/completions, greedy:

- `random`: random-token prompts (--random-input-len, --random-output-len, ignore_eos);
- `prefix_repetition`: a few shared prefixes, each followed by a distinct suffix (what a
  prefix cache is for), ignore_eos.

Client side (vllm bench): TTFT p50/p99, ITL p50/p99, TPOT, output throughput, failures.
Server side, from each server's /metrics before and after each workload (histogram sums and
counts; they include the client's one initial test request): mean TTFT from the request's
arrival in the engine, mean inter-token latency (one engine step per token while a request
decodes), prefix-cache hit tokens. Client TTFT minus server TTFT is the time outside the
engine: HTTP, JSON, tokenization, streaming.

    make bench-serving-vs-vllm   (= .venv/bin/python -m benchmarks.bench_serving_vs_vllm [--quick])

Writes benchmarks/results/serving_vs_vllm.json and .md (`--quick`: serving_vs_vllm_quick.*,
small sizes that only check the script runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.default_model import ensure_default_model
from harness import process
from harness.serve import ServeProcess
from harness.vllm import VllmServer, vllm_env

REPO = Path(__file__).resolve().parents[1]

RESULTS = REPO / "benchmarks" / "results"
VLLM_VENV = REPO / ".venv-vllm"
NAME = "SmolLM2-135M-Instruct"
KV_GIB = 2
SHARED = ["--max-num-seqs", "64", "--max-num-batched-tokens", "2048", "--max-model-len", "4096"]
# Server-side histograms (the last three only vLLM has: its split of a request's time).
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds")
CPU_TIER = {"tiers": ["cpu?budget=4GiB"]}  # the connector's tiers in this comparison


def workloads(quick: bool) -> dict[str, list[str]]:
    """Returns `vllm bench serve` arguments per workload (the dataset and its sizes)."""
    n_in, n_out, prefix, suffix = (128, 16, 128, 32) if quick else (512, 64, 512, 128)
    return {
        "random": ["--dataset-name", "random", "--random-input-len", str(n_in), "--random-output-len", str(n_out)],
        "prefix_repetition": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(prefix),
                              "--prefix-repetition-suffix-len", str(suffix), "--prefix-repetition-num-prefixes", "4",
                              "--prefix-repetition-output-len", str(n_out), "--ignore-eos"],
    }


def vllm_serve(model: Path, log: Path, extra_config: dict[str, Any] | None = CPU_TIER,
               args: Sequence[str] = SHARED, env: dict[str, str] | None = None) -> VllmServer:
    """Returns a ready `kvtier-vllm serve` from .venv-vllm with KVTierConnector over a `cpu` tier
    (or `extra_config`; None: no connector); `args` are vLLM's engine flags; `env` adds to its
    environment (e.g. VLLM_CPU_OMP_THREADS_BIND). Its `close()` drains it with SIGINT.
    benchmarks/soak_engines.py and bench_fleet use it too."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(KV_GIB), **(env or {})}
    iomp = VLLM_VENV / "lib" / "libiomp5.so"
    if iomp.exists():  # vLLM's CPU docs' setup, as bench_vs_vllm gives it
        env["LD_PRELOAD"] = os.environ.get("LD_PRELOAD", str(iomp))
    return VllmServer(model, extra_config, log, cli=True, python=VLLM_VENV / "bin" / "python", name=NAME,
                      engine_flags=args, shutdown_timeout=30, start_timeout=600, env=env)


def scrape(url: str, prefix: str) -> dict[str, float]:
    """Returns /metrics' samples named `prefix*` by sample name, summed over labels."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in family.samples:
            if s.name.startswith(prefix):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def server_side(before: dict[str, float], after: dict[str, float], prefix: str) -> dict[str, float]:
    """Returns the server's own figures over one workload: the mean (ms) of each of HISTOGRAMS
    it has (`server_mean_<name>_ms`), and prefix-cache tokens looked up and hit."""
    def d(name: str) -> float:
        return after.get(prefix + name, 0.0) - before.get(prefix + name, 0.0)

    out: dict[str, float] = {}
    for m in HISTOGRAMS:
        count = d(m + "_count")
        if count:
            out[f"server_mean_{m.removesuffix('_seconds')}_ms"] = d(m + "_sum") / count * 1e3
    out["prefix_cache_queries"] = d("prefix_cache_queries_total")
    out["prefix_cache_hits"] = d("prefix_cache_hits_total")
    return out


def bench(url: str, model: Path, dataset: list[str], args: argparse.Namespace, out_dir: Path,
          label: str) -> dict[str, Any]:
    """Runs `vllm bench serve` against `url`; returns its result JSON (per-request lists dropped,
    non-empty error strings kept)."""
    cmd = [str(VLLM_VENV / "bin" / "kvtier-vllm"), "bench", "serve", "--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", NAME, "--tokenizer", str(model), *dataset,
           "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate), "--seed", "0",
           "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(out_dir),
           "--result-filename", f"{label}.json"]
    log = out_dir / f"{label}.log"
    with log.open("w") as f:
        proc = process.run(cmd, cwd=REPO, env=vllm_env(VLLM_CPU_KVCACHE_SPACE=str(KV_GIB)), stdout=f,
                           stderr=subprocess.STDOUT, timeout=1800)
    result = out_dir / f"{label}.json"
    if proc.returncode or not result.exists():
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if "nanobind" not in ln and
                not ln.startswith(" - ")][-15:]
        raise RuntimeError(f"vllm bench serve failed (exit {proc.returncode}) against {url}:\n" + "\n".join(tail))
    data: dict[str, Any] = json.loads(result.read_text())
    errors = [e for e in data.get("errors", []) if e]
    keep = {k: v for k, v in data.items() if not isinstance(v, list)}
    keep["error_messages"] = sorted(set(errors))[:5]
    return keep


def run_server(kind: str, model: Path, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Starts one server, runs every workload against it, stops it; returns results by workload."""
    t0 = time.perf_counter()
    server: ServeProcess | VllmServer
    if kind == "kvtier":
        server = ServeProcess("--model", str(model), "--served-model-name", NAME, "--device", "cpu",
                              "--dtype", "float32", "--kv-cache-memory-bytes", str(KV_GIB << 30), *SHARED,
                              "--kv-tier", "cpu?budget=4GiB")
        prefix = "kvtier:"
    else:
        server = vllm_serve(model, tmp / "vllm_serve.log")
        prefix = "vllm:"
    started = time.perf_counter() - t0
    out: dict[str, Any] = {"startup_s": started}
    try:
        for name, dataset in workloads(args.quick).items():
            print(f"{kind}: {name} ...", file=sys.stderr)
            before = scrape(server.url, prefix)
            res = bench(server.url, model, dataset, args, tmp, f"{kind}_{name}")
            res.update(server_side(before, scrape(server.url, prefix), prefix))
            out[name] = res
    finally:
        code = server.close() if isinstance(server, VllmServer) else server.stop()
    if code != 0:
        print(f"warning: {kind} server exited {code}", file=sys.stderr)
    return out


ROWS = [("TTFT p50 (ms)", "p50_ttft_ms", "lower"), ("TTFT p99 (ms)", "p99_ttft_ms", "lower"),
        ("ITL p50 (ms)", "p50_itl_ms", "lower"), ("ITL p99 (ms)", "p99_itl_ms", "lower"),
        ("TPOT mean (ms)", "mean_tpot_ms", "lower"), ("output throughput (tok/s)", "output_throughput", "higher"),
        ("requests completed / failed", None, ""),
        ("server: mean TTFT from arrival (ms)", "server_mean_time_to_first_token_ms", "lower"),
        ("client mean TTFT - server mean TTFT (ms)", "outside_engine_ms", "lower"),
        ("server: mean inter-token latency (ms)", "server_mean_inter_token_latency_ms", "lower"),
        ("prefix-cache hit tokens / looked up", None, "")]


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = []
    for wl in results["kvtier"]:
        if wl == "startup_s":
            continue
        k, v = results["kvtier"][wl], results["vllm"][wl]
        lines += [f"**{wl}**", "", "| figure | kvtier serve | vllm serve + connector | kvtier / vLLM |",
                  "|---|---:|---:|---:|"]
        for label, key, better in ROWS:
            if key is None and label.startswith("requests"):
                lines.append(f"| {label} | {k['completed']} / {k['failed']} | {v['completed']} / {v['failed']} | |")
            elif key is None:
                lines.append(f"| {label} | {k['prefix_cache_hits']:.0f} / {k['prefix_cache_queries']:.0f} | "
                             f"{v['prefix_cache_hits']:.0f} / {v['prefix_cache_queries']:.0f} | |")
            else:
                ratio = k[key] / v[key] if v[key] else float("nan")
                lines.append(f"| {label} | {k[key]:.1f} | {v[key]:.1f} | **{ratio:.2f}x** ({better} is better) |")
        lines.append("")
    return "\n".join(lines)


def where_time_goes(results: dict[str, dict[str, Any]]) -> list[str]:
    """Returns one line per workload: the figures where kvtier serve is slower, and its mean
    TTFT and inter-token latency gaps to vLLM split into engine and outside-engine time."""
    notes = []
    for wl, k in results["kvtier"].items():
        if wl == "startup_s":
            continue
        v = results["vllm"][wl]
        slower = [label for label, key, better in ROWS if key is not None and
                  ((better == "lower" and k[key] > v[key]) or (better == "higher" and k[key] < v[key]))]
        if not slower:
            notes.append(f"- {wl}: kvtier serve is slower on no figure above.")
            continue
        ttft = k["mean_ttft_ms"] - v["mean_ttft_ms"]
        engine = k["server_mean_time_to_first_token_ms"] - v["server_mean_time_to_first_token_ms"]
        itl_server = k["server_mean_inter_token_latency_ms"] - v["server_mean_inter_token_latency_ms"]
        notes.append(f"- {wl}: kvtier serve is slower on {', '.join(slower)}. Mean TTFT gap {ttft:+.1f} ms: "
                     f"{engine:+.1f} ms in the engine (arrival to first token), {ttft - engine:+.1f} ms outside it "
                     f"(HTTP, JSON, tokenization, streaming). Mean inter-token latency gap: {itl_server:+.1f} ms "
                     f"on the server (engine steps), {k['mean_itl_ms'] - v['mean_itl_ms']:+.1f} ms at the client.")
    return notes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (checks the script runs)")
    ap.add_argument("--num-prompts", type=int, default=None, help="requests per workload (default: 48; quick: 6)")
    ap.add_argument("--request-rate", type=float, default=2.0, help="Poisson arrivals per second (default: 2)")
    args = ap.parse_args()
    if args.num_prompts is None:
        args.num_prompts = 6 if args.quick else 48
    if not (VLLM_VENV / "bin" / "kvtier-vllm").exists():
        print("no .venv-vllm/bin/kvtier-vllm: run `make vllm-install` first", file=sys.stderr)
        return 2
    model = ensure_default_model()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-serving-vs-vllm-") as tmp:
        for kind in ("kvtier", "vllm"):
            results[kind] = run_server(kind, model, args, Path(tmp))
    for per in results.values():
        for wl, r in per.items():
            if wl != "startup_s":
                r["outside_engine_ms"] = r["mean_ttft_ms"] - r["server_mean_time_to_first_token_ms"]
    res = {"quick": args.quick, "platform": platform.platform(), "num_prompts": args.num_prompts,
           "request_rate": args.request_rate, "workloads": workloads(args.quick), "kv_cache_gib": KV_GIB,
           "shared_flags": SHARED, "results": results}
    suffix = "_quick" if args.quick else ""
    md = (table(results) + "\nWhere the time goes (kvtier serve minus vllm serve):\n\n"
          + "\n".join(where_time_goes(results)))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"serving_vs_vllm{suffix}.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / f"serving_vs_vllm{suffix}.md").write_text(
        f"# kvtier serve vs vllm serve + KVTierConnector, measured by `vllm bench serve` ({args.num_prompts} "
        f"requests per workload at {args.request_rate} req/s, Poisson, seed 0, greedy, streaming; cpu tier on both; "
        f"fp32 SmolLM2-135M, 2-core CPU)\n\n{md}\n")
    print(md)
    failed = sum(r["failed"] for per in results.values() for wl, r in per.items() if wl != "startup_s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
