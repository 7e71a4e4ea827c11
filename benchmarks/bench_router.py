"""Routing across two `kvtier serve` instances, and disaggregated prefill; ratios in one run.

Two instances on this 2-core machine, one thread each (OMP_NUM_THREADS=1), behind
`kvtier router`. Every arm starts fresh processes, so no arm inherits another's cache.

Part 1, routing (LMCache's multi-round QA shape, as `bench_serving`): U users, each with a
long private context and a growing chat, R rounds, C users at a time. Each instance's KV pool
holds about half the users' histories, so the two together hold them all only if each user
keeps landing on the instance that has its history. Arms: `kv-aware`, `prefix-hash`,
`round-robin` (engine prefix caches only: routing is the only thing that differs).
Target: kv-aware mean TTFT (follow-up rounds) >= 2x lower than round-robin.

Part 2, disaggregated prefill: N requests with distinct long prompts arrive at a fixed
interval (an offered load both configurations sustain, so throughput is equal by design and
reported) and stream A tokens each. Arms: two colocated instances (`kv-aware` router, shared
cache server) vs a producer and a consumer (`--prefill/--decode` router, same cache server).
Target: p99 inter-token latency lower disaggregated (no prefill step ever runs on the
instance that decodes).

    .venv/bin/python -m benchmarks.bench_router [--quick] [--users 8] [--rounds 3]
        [--concurrency 4] [--context-tokens 1500] [--pd-requests 12] [--pd-interval 4]

Writes benchmarks/results/router.json and router.md and prints the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.bench_serving import chat_stream, context_text, pct, qa_arguments, ratio_rows, run_arm
from engine.default_model import ensure_default_model
from harness.cache_server import CacheServerProcess
from harness.serve import RouterProcess, ServeProcess

REPO = Path(__file__).resolve().parents[1]

RESULTS = REPO / "benchmarks" / "results"
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def start_servers(flags: list[list[str]]) -> list[ServeProcess]:
    """Returns started serve processes, one per flag list (started together, then awaited)."""
    procs = [ServeProcess(*f, env=ONE_THREAD, wait=False) for f in flags]
    for p in procs:
        p.wait_ready()
    return procs


def served_counts(router: RouterProcess) -> dict[str, float]:
    """Returns the router's requests per backend URL."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(router.url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == "kvtier:router_requests_total":
                out[s.labels["backend"]] = out.get(s.labels["backend"], 0.0) + s.value
    return out


def routing_arm(policy: str, engine: list[str], contexts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    servers = start_servers([engine, engine])
    router = RouterProcess(*[f"--backend={s.url}" for s in servers], "--policy", policy)
    try:
        res = asyncio.run(run_arm(router.url, contexts, args.rounds, args.concurrency, args.answer_tokens))
        counts = served_counts(router)
        res["requests_per_backend"] = [counts.get(s.url, 0.0) for s in servers]
        return res
    finally:
        router.stop()
        for s in servers:
            s.stop()


async def pd_load(url: str, prompts: list[str], interval: float, answer_tokens: int) -> dict[str, Any]:
    """Sends one streamed chat per prompt, `interval` s apart; returns TTFT, ITL, throughput."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(i: int, p: str) -> dict[str, Any]:
            await asyncio.sleep(i * interval)
            return await chat_stream(client, [{"role": "user", "content": p}], answer_tokens)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
    gaps = [g for r in results for g in r["gaps"]]
    ttfts = [r["ttft"] for r in results]
    out = sum(r["usage"]["completion_tokens"] for r in results)
    return {"mean_ttft_s": statistics.mean(ttfts), "ttft_p99_s": pct(ttfts, 99),
            "itl_p50_s": pct(gaps, 50), "itl_p90_s": pct(gaps, 90), "itl_p99_s": pct(gaps, 99),
            "itl_max_s": max(gaps), "output_tokens": out, "wall_s": wall, "throughput_tok_s": out / wall,
            "mean_cached_tokens": statistics.mean(r["usage"]["prompt_tokens_details"]["cached_tokens"]
                                                  for r in results),
            "texts": [r["text"] for r in results]}


def pd_arm(disaggregated: bool, engine: list[str], prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    cache = CacheServerProcess("--max-bytes", "4GiB")
    tier = ["--kv-tier", cache.url]
    try:
        if disaggregated:
            servers = start_servers([[*engine, *tier, "--kv-role", "producer"],
                                     [*engine, *tier, "--kv-role", "consumer"]])
            router = RouterProcess("--prefill", servers[0].url, "--decode", servers[1].url)
        else:
            servers = start_servers([[*engine, *tier], [*engine, *tier]])
            router = RouterProcess(*[f"--backend={s.url}" for s in servers], "--policy", "kv-aware")
        try:
            return asyncio.run(pd_load(router.url, prompts, args.pd_interval, args.pd_answer_tokens))
        finally:
            router.stop()
            for s in servers:
                s.stop()
    finally:
        cache.stop()


def tables(res: dict[str, Any]) -> str:
    lines = ["| routing policy | mean TTFT follow-up (all rounds) | TTFT p50 / p99 | ITL p99 | out tok/s | "
             "cached tok (follow-up, mean) | requests per instance |", "|---|---|---|---|---|---|---|"]
    for name, a in res.get("routing", {}).items():
        lines.append(f"| {name} | {a['mean_ttft_s'] * 1e3:.0f} ms ({a['mean_ttft_all_rounds_s'] * 1e3:.0f} ms) | "
                     f"{a['ttft_p50_s'] * 1e3:.0f} / {a['ttft_p99_s'] * 1e3:.0f} ms | {a['itl_p99_s'] * 1e3:.0f} ms | "
                     f"{a['throughput_tok_s']:.1f} | {a['mean_cached_tokens_followup']:.0f} | "
                     f"{' / '.join(f'{x:.0f}' for x in a['requests_per_backend'])} |")
    lines += ["", "| prefill placement | mean TTFT | ITL p50 / p90 / p99 / max | out tok/s | cached tok (mean) |",
              "|---|---|---|---|---|"]
    for name, a in res.get("pd", {}).items():
        lines.append(f"| {name} | {a['mean_ttft_s'] * 1e3:.0f} ms | {a['itl_p50_s'] * 1e3:.0f} / "
                     f"{a['itl_p90_s'] * 1e3:.0f} / {a['itl_p99_s'] * 1e3:.0f} / {a['itl_max_s'] * 1e3:.0f} ms | "
                     f"{a['throughput_tok_s']:.2f} | {a['mean_cached_tokens']:.0f} |")
    return "\n".join(lines + ratio_rows({k: (r["value"], r["target"]) for k, r in res["ratios"].items()}))


def main() -> int:
    ap = qa_arguments(__doc__.splitlines()[0], context_tokens=1500, answer_tokens=24)
    ap.add_argument("--pd-requests", type=int, default=10)
    ap.add_argument("--pd-interval", type=float, default=8.0,
                    help="seconds between part-2 arrivals (one producer thread must keep up: equal throughput)")
    ap.add_argument("--pd-prompt-tokens", type=int, default=1200)
    ap.add_argument("--pd-answer-tokens", type=int, default=64)
    ap.add_argument("--only", choices=["routing", "pd"], default=None,
                    help="run one part; the other part's figures are kept from the existing results file")
    args = ap.parse_args()
    if args.quick:
        args.users, args.rounds, args.concurrency, args.context_tokens, args.answer_tokens = 4, 2, 2, 300, 8
        args.pd_requests, args.pd_interval, args.pd_prompt_tokens, args.pd_answer_tokens = 3, 1.0, 300, 16
    model = args.model or str(ensure_default_model())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    contexts = [context_text(u, tok, args.context_tokens) for u in range(args.users)]
    per_user_blocks = (args.context_tokens + args.rounds * (args.answer_tokens + 64)) // 16 + 8
    # Each instance: room for half the users' histories (plus slack), not for all of them.
    blocks = per_user_blocks * (args.users // 2) + per_user_blocks // 2
    engine = ["--model", model, "--device", "cpu", "--num-gpu-blocks", str(blocks),
              "--max-num-seqs", str(args.concurrency)]
    suffix = "_quick" if args.quick else ""
    previous = RESULTS / f"router{suffix}.json"
    res: dict[str, Any] = json.loads(previous.read_text()) if args.only and previous.exists() else {}
    res.update({"quick": args.quick, "platform": platform.platform(), "threads_per_instance": 1})
    ratios: dict[str, tuple[float, str]] = {k: (v["value"], v["target"]) for k, v in res.get("ratios", {}).items()}
    if args.only != "pd":
        res.update({"users": args.users, "rounds": args.rounds, "concurrency": args.concurrency,
                    "context_tokens": args.context_tokens, "answer_tokens": args.answer_tokens,
                    "num_gpu_blocks_per_instance": blocks, "routing": {}})
        for policy in ("kv-aware", "prefix-hash", "round-robin"):
            print(f"routing: {policy} ...", file=sys.stderr)
            res["routing"][policy] = routing_arm(policy, engine, contexts, args)
        kv, rr, ph = (res["routing"][p] for p in ("kv-aware", "round-robin", "prefix-hash"))
        ratios.update({
            "mean TTFT follow-up, round-robin / kv-aware": (rr["mean_ttft_s"] / kv["mean_ttft_s"], ">= 2"),
            "mean TTFT follow-up, round-robin / prefix-hash": (rr["mean_ttft_s"] / ph["mean_ttft_s"], "reported"),
            "mean TTFT all rounds, round-robin / kv-aware":
                (rr["mean_ttft_all_rounds_s"] / kv["mean_ttft_all_rounds_s"], "reported")})
    if args.only != "routing":
        res.update({"pd_requests": args.pd_requests, "pd_interval_s": args.pd_interval,
                    "pd_prompt_tokens": args.pd_prompt_tokens, "pd_answer_tokens": args.pd_answer_tokens, "pd": {}})
        prompts = [f"Request {i}. " + context_text(100 + i, tok, args.pd_prompt_tokens) + "\n\nSummarise."
                   for i in range(args.pd_requests)]
        pd_engine = ["--model", model, "--device", "cpu", "--max-num-seqs", "16"]
        for name, disagg in (("colocated (2 instances, kv-aware)", False),
                             ("disaggregated (producer + consumer)", True)):
            print(f"pd: {name} ...", file=sys.stderr)
            res["pd"][name] = pd_arm(disagg, pd_engine, prompts, args)
        co, dis = res["pd"].values()
        ratios["p99 ITL, disaggregated / colocated"] = (dis["itl_p99_s"] / co["itl_p99_s"], "< 1")
        ratios["throughput, disaggregated / colocated"] = (dis["throughput_tok_s"] / co["throughput_tok_s"],
                                                          "~1 (equal offered load)")
        ratios["mean TTFT, disaggregated / colocated"] = (dis["mean_ttft_s"] / co["mean_ttft_s"], "reported")
        ratios["answers identical, disaggregated vs colocated"] = (float(dis["texts"] == co["texts"]), "1")
    res["ratios"] = {k: {"value": v, "target": t} for k, (v, t) in ratios.items()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    md = tables(res)
    (RESULTS / f"router{suffix}.json").write_text(json.dumps(res, indent=2) + "\n")
    parts = []
    if "routing" in res:
        parts.append(f"Routing: {res['users']} users x {res['rounds']} rounds, {res['concurrency']} concurrent, "
                     f"~{res['context_tokens']}-token contexts, {res['answer_tokens']}-token answers, "
                     f"{res['num_gpu_blocks_per_instance']} KV blocks per instance (about half the users' histories).")
    if "pd" in res:
        parts.append(f"Disaggregation: {res['pd_requests']} distinct ~{res['pd_prompt_tokens']}-token prompts, one "
                     f"every {res['pd_interval_s']:g} s, {res['pd_answer_tokens']}-token answers, shared cache server.")
    (RESULTS / f"router{suffix}.md").write_text(
        "# Router: two instances, one thread each (2-core CPU, fp32)\n\n" + " ".join(parts)
        + f" Each part's ratios come from one run of that part.\n\n{md}\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
