"""A fleet driven by a production trace: a slice of Mooncake's conversation trace, scaled to this
machine, sent through `kvtier router --policy kv-aware` to three `kvtier serve` sharing one
cache server, under each eviction policy of the server; the hit rate each arm measured against
the replay of the same slice at the same capacity (kvstore/trace_replay.py `plan`).

Scaling: each 512-token block of the trace becomes `--block-tokens` (16) tokens: token ids drawn
from a generator seeded by the block's hash id, so two prompts share exactly the blocks they
share in the trace; a prompt's last block keeps its share of a block. Requests go in arrival
order through a closed loop of `--concurrency` clients (the trace's hour compressed to as fast
as the fleet answers), each a streamed `/v1/completions` of the token ids with `--answer-tokens`
tokens. The servers run without the engine's prefix cache and with `--chunk-size` equal to the
block, so every reused token comes from the shared tier, as in the replay; the cache server
holds `--share` of the slice's distinct blocks (`--max-bytes` sized by a stored chunk's bytes).

Per arm: prompt tokens computed, the measured token hit rate (cached over prompt tokens) and
the replay's, TTFT p50/p90/p99, requests/s. Writes benchmarks/results/fleet_trace.{json,md}.

    .venv/bin/python -m benchmarks.bench_fleet_trace [--requests 600] [--share 0.05] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.bench_fleet import kv_bytes_per_token
from benchmarks.bench_router import served_counts, start_servers
from benchmarks.bench_serving import pct
from benchmarks.bench_trace import TRACES
from benchmarks.sim.live_run import VOCAB, complete
from engine.default_model import ensure_default_model
from harness.cache_server import CacheServerProcess
from harness.serve import RouterProcess
from kvstore.eviction import POLICIES
from kvstore.store_config import TierSpec
from kvstore.trace_replay import Request, plan, read_trace

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CHUNK_OVERHEAD = 1024  # a stored chunk's key, header and checksum, above its K/V (an upper bound)


def scaled(requests: list[Request], block_tokens: int) -> list[Request]:
    """Returns `requests` with each block of `block_size` tokens scaled to `block_tokens`."""
    out = []
    for r in requests:
        length = max(1, round(r.input_length * block_tokens / r.block_size))
        length = min(length, len(r.blocks) * block_tokens)
        out.append(Request(length, r.blocks, block_tokens))
    return out


def prompt_ids(request: Request) -> list[int]:
    """Returns the request's prompt: per block, `block_size` token ids seeded by its hash id."""
    ids: list[int] = []
    for i, block in enumerate(request.blocks):
        rng = random.Random(block)
        ids += [rng.randrange(*VOCAB) for _ in range(request.block_tokens(i))]
    return ids


async def send(url: str, prompts: list[list[int]], concurrency: int, answer_tokens: int) -> dict[str, Any]:
    """Sends every prompt in order through `concurrency` clients; returns the arm's figures."""
    records: list[dict[str, Any]] = []
    todo = list(enumerate(prompts))
    async with httpx.AsyncClient(timeout=1200) as client:
        async def worker() -> None:
            while todo:
                i, ids = todo.pop(0)
                records.append({"request": i, **await complete(client, url, ids, answer_tokens)})

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ttfts = [r["ttft_s"] for r in records]
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    return {"requests": len(records), "wall_s": wall, "requests_per_s": len(records) / wall,
            "prompt_tokens": prompt, "computed_prompt_tokens": prompt - cached, "hit_rate": cached / prompt,
            "ttft_mean_s": statistics.mean(ttfts), "ttft_p50_s": pct(ttfts, 50), "ttft_p90_s": pct(ttfts, 90),
            "ttft_p99_s": pct(ttfts, 99)}


def arm(policy: str, model: str, prompts: list[list[int]], max_bytes: int, args: argparse.Namespace,
        pool_blocks: int) -> dict[str, Any]:
    """Runs one arm with fresh processes: the cache server evicting by `policy`, three servers
    over it, the kv-aware router; returns its figures."""
    server = CacheServerProcess("--max-bytes", str(max_bytes), "--eviction", policy)
    try:
        engine = ["--model", model, "--device", "cpu", "--num-gpu-blocks", str(pool_blocks), "--max-num-seqs", "1",
                  "--no-prefix-caching", "--chunk-size", str(args.block_tokens), "--kv-tier", server.url]
        servers = start_servers([engine] * 3)
        try:
            router = RouterProcess(*[f"--backend={s.url}" for s in servers], "--policy", "kv-aware")
            try:
                res = asyncio.run(send(router.url, prompts, args.concurrency, args.answer_tokens))
                counts = served_counts(router)
            finally:
                router.stop()
        finally:
            for s in servers:
                s.stop()
        res["requests_per_instance"] = [counts.get(s.url, 0.0) for s in servers]
        return res
    finally:
        server.stop()


def markdown(res: dict[str, Any]) -> str:
    w = res["workload"]
    lines = ["# A fleet driven by a production trace (2-core CPU, fp32 SmolLM2-135M)", "",
             f"Requests {w['start']}-{w['start'] + w['requests'] - 1} of Mooncake's {w['trace']} trace, each "
             f"512-token block scaled to {w['block_tokens']} tokens ({w['prompt_tokens']:,} prompt tokens, "
             f"{w['distinct_blocks']:,} distinct blocks), sent in arrival order by {w['concurrency']} clients "
             f"through `kvtier router --policy kv-aware` to three `kvtier serve` (one thread each, no engine "
             f"prefix cache, chunks of one block) sharing one cache server that holds {w['share']:.0%} of the "
             f"distinct blocks ({w['capacity_blocks']:,}); {w['answer_tokens']}-token answers. `replay`: the same "
             "slice through kvstore/trace_replay.py at the same capacity. One run: "
             f"{res['date']}.", "",
             "| cache server eviction | hit rate, measured / replay | measured / replay | prompt tokens computed "
             "| TTFT p50 / p90 / p99 | requests/s | requests per instance |",
             "|---|---|---:|---:|---|---:|---|"]
    for policy, a in res["arms"].items():
        lines.append(f"| {policy} | {a['hit_rate']:.3f} / {a['replay_hit_rate']:.3f} "
                     f"| {a['hit_rate'] / a['replay_hit_rate']:.3f} | {a['computed_prompt_tokens']:,} "
                     f"| {a['ttft_p50_s']:.2f} / {a['ttft_p90_s']:.2f} / {a['ttft_p99_s']:.2f} s "
                     f"| {a['requests_per_s']:.2f} | {' / '.join(f'{x:.0f}' for x in a['requests_per_instance'])} |")
    arms = res["arms"]
    if "lru" in arms and len(arms) > 1:
        lines += ["", "Prompt tokens computed, LRU / each other policy: " + "; ".join(
            f"{p} {arms['lru']['computed_prompt_tokens'] / a['computed_prompt_tokens']:.3f}"
            for p, a in arms.items() if p != "lru") + "."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="conversation", help="a trace under benchmarks/traces/mooncake")
    ap.add_argument("--start", type=int, default=0, help="the slice's first request")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--block-tokens", type=int, default=16, help="tokens per trace block here (and per chunk)")
    ap.add_argument("--share", type=float, default=0.05, help="cache server capacity, share of distinct blocks")
    ap.add_argument("--policies", default="lru,reuse", help=f"cache server eviction policies ({', '.join(POLICIES)})")
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--answer-tokens", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="60 requests (validates the script)")
    args = ap.parse_args()
    if args.quick:
        args.requests = 60
    model = str(ensure_default_model())
    trace = read_trace(TRACES / f"{args.trace}_trace.jsonl.gz")[args.start:args.start + args.requests]
    requests = scaled(trace, args.block_tokens)
    prompts = [prompt_ids(r) for r in requests]
    distinct = len({b for r in requests for b in r.blocks})
    capacity = max(1, int(distinct * args.share))
    per_token = kv_bytes_per_token(model)
    max_bytes = capacity * (args.block_tokens * per_token + CHUNK_OVERHEAD)
    pool_blocks = max(len(p) for p in prompts) // 16 + 2 + args.answer_tokens // 16 + 1
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "quick": args.quick, "workload": {
        "trace": args.trace, "start": args.start, "requests": len(requests), "block_tokens": args.block_tokens,
        "prompt_tokens": sum(len(p) for p in prompts), "distinct_blocks": distinct, "share": args.share,
        "capacity_blocks": capacity, "cache_server_max_bytes": max_bytes, "concurrency": args.concurrency,
        "answer_tokens": args.answer_tokens, "engine_pool_blocks": pool_blocks}, "arms": {}}
    for policy in args.policies.split(","):
        replay = plan(requests, [TierSpec(url="kvtier://replay:1", budget=capacity * args.block_tokens * per_token,
                                          eviction=policy)], per_token)
        print(f"fleet: {policy} (replay: hit rate {replay.hit_rate:.3f}) ...", file=sys.stderr)
        res["arms"][policy] = arm(policy, model, prompts, max_bytes, args, pool_blocks) | {
            "replay_hit_rate": replay.hit_rate}
    out = RESULTS / ("fleet_trace_quick" if args.quick else "fleet_trace")
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    md = markdown(res)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
