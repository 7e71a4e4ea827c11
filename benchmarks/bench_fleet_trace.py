"""A fleet driven by a production trace: a slice of Mooncake's conversation trace, scaled to this
machine, sent through `kvtier router --policy kv-aware` to three `kvtier serve` sharing one
cache server, under each eviction policy of the server; the hit rate each arm measured against
the replay of the same slice at the same capacity (kvstore/trace_replay.py `plan`).

Scaling: each 512-token block of the trace becomes `--block-tokens` (16; vLLM 32) tokens: token ids drawn
from a generator seeded by the block's hash id, so two prompts share exactly the blocks they
share in the trace; a prompt's last block keeps its share of a block. Requests go in arrival
order through a closed loop of `--concurrency` clients (the trace's hour compressed to as fast
as the fleet answers), each a streamed `/v1/completions` of the token ids with `--answer-tokens`
tokens. The servers run without the engine's prefix cache and with `--chunk-size` equal to the
block, so every reused token comes from the shared tier, as in the replay; the cache server
holds `--share` of the slice's distinct blocks (`--max-bytes` sized by a stored chunk's bytes).

`--engine vllm`: the same slice to three `vllm serve` with kvtier's connector (from .venv-vllm,
bench_fleet's start_vllm_fleet: one OpenMP thread each, VLLM_CPU_KVCACHE_SPACE 2, fp32 as the
kvtier arm) over the same kind of cache server. vLLM's CPU attention takes block sizes that are
multiples of 32, so there a trace block is 32 tokens (`--block-tokens` default 32): `--block-size`
and the connector's `chunk_size` both one block, vLLM's prefix cache off
(`--no-enable-prefix-caching`), `--max-model-len` the model's context (a request past it is
left out of the slice and counted in the workload).

Per arm: prompt tokens computed, the measured token hit rate and the replay's, TTFT
p50/p90/p99, requests/s, and the servers' own connector counters and the cache server's STATS.
Measured hit tokens are the usage's `prompt_tokens_details.cached_tokens` (vLLM: local plus
connector-loaded tokens, and its prefix cache is off), counted as the replay counts them: the
lookup of both engines stops one token short of the prompt (its logits are needed), so a hit
that reached the prompt's last token (cached = prompt - 1) counts the whole prompt, as the
replay's whole blocks do (`hit_rate`; `cached_rate` is cached over prompt tokens as reported).
Writes benchmarks/results/fleet_trace.{json,md}, each engine's arms kept from the existing file
when the other runs.

    .venv/bin/python -m benchmarks.bench_fleet_trace [--engine kvtier|vllm] [--requests 600] [--share 0.05]
        [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.bench_fleet import kv_bytes_per_token, start_vllm_fleet
from benchmarks.bench_router import served_counts, start_servers
from benchmarks.bench_serving import pct
from benchmarks.bench_serving_vs_vllm import scrape
from benchmarks.bench_trace import TRACES
from benchmarks.sim.live_run import VOCAB, complete
from engine.default_model import ensure_default_model
from harness.cache_server import CacheServerProcess
from harness.serve import RouterProcess
from kvstore.backends.server_client import CacheServerClient
from kvstore.eviction import POLICIES
from kvstore.store_config import TierSpec
from kvstore.trace_replay import plan
from kvstore.traces import Request, read_trace

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CHUNK_OVERHEAD = 1024  # a stored chunk's key, header and checksum, above its K/V (an upper bound)
VLLM_BLOCK_MULTIPLE = 32  # vLLM's CPU attention takes block sizes that are multiples of 32 (cpu_attn.py)
ENGINE_TITLES = {"kvtier": "three `kvtier serve`", "vllm": "three `vllm serve` + kvtier's connector"}
# the servers' own connector counters kept per arm (summed over the three): kvtier:<name>_total
COUNTERS = ("kv_connector_hit_tokens", "kv_load_error_tokens", "kv_stored_tokens", "kv_stored_bytes",
            "kv_dropped_store_bytes", "kv_tier_dropped_writes")


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


def hit_tokens(prompt: int, cached: int) -> int:
    """Returns a request's hit tokens as the replay counts them: `cached`, or the whole prompt
    where the hit reached its last token (cached = prompt - 1: an engine computes the last
    prompt token whatever it holds, for its logits; the replay counts whole blocks)."""
    return prompt if cached and cached == prompt - 1 else cached


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
    hits = sum(hit_tokens(r["prompt_tokens"], r["cached_tokens"]) for r in records)
    return {"requests": len(records), "wall_s": wall, "requests_per_s": len(records) / wall,
            "prompt_tokens": prompt, "computed_prompt_tokens": prompt - cached, "hit_rate": hits / prompt,
            "cached_rate": cached / prompt, "hits_to_the_last_token": sum(
                1 for r in records if r["cached_tokens"] and r["cached_tokens"] == r["prompt_tokens"] - 1),
            "ttft_mean_s": statistics.mean(ttfts), "ttft_p50_s": pct(ttfts, 50), "ttft_p90_s": pct(ttfts, 90),
            "ttft_p99_s": pct(ttfts, 99)}


@dataclass(frozen=True)
class Fleet:
    """One engine's three servers: `start` returns them ready over a cache server (its URL),
    each with a `url`; `stop` stops them."""

    start: Callable[[str], list[Any]]
    stop: Callable[[list[Any]], None]


def kvtier_fleet(model: str, args: argparse.Namespace, pool_blocks: int) -> Fleet:
    """Returns three `kvtier serve` (one thread each, no engine prefix cache, chunks of one block)."""
    def start(url: str) -> list[Any]:
        engine = ["--model", model, "--device", "cpu", "--num-gpu-blocks", str(pool_blocks), "--max-num-seqs", "1",
                  "--no-prefix-caching", "--chunk-size", str(args.block_tokens), "--kv-tier", url]
        return start_servers([engine] * 3)

    def stop(servers: list[Any]) -> None:
        for s in servers:
            s.stop()

    return Fleet(start, stop)


def vllm_flags(args: argparse.Namespace) -> list[str]:
    """Returns vLLM's engine flags for the vLLM arm: one sequence at a time as the kvtier arm,
    blocks of one trace block, no prefix cache of its own, a pool of one longest sequence."""
    return ["--max-num-seqs", "1", "--max-model-len", str(args.max_model_len), "--block-size", str(args.block_tokens),
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
            "--num-gpu-blocks-override", str(args.max_model_len // args.block_tokens + 2)]


def vllm_fleet(model: str, args: argparse.Namespace, logs: Path) -> Fleet:
    """Returns three `vllm serve` + kvtier's connector (bench_fleet.start_vllm_fleet) over the
    cache server alone, chunks of one block."""
    from harness.vllm import close_together

    return Fleet(lambda url: start_vllm_fleet(model, {"tiers": [url], "chunk_size": args.block_tokens},
                                              vllm_flags(args), logs),
                 lambda servers: close_together(*servers))


def values_per_chunk(model: str, engine: str) -> int:
    """Returns the cache server values one chunk is stored as: one (kvtier's engine), or one per
    KV head (vLLM's connector keys chunks per head, so any tensor-parallel size loads them)."""
    return json.loads((Path(model) / "config.json").read_text())["num_key_value_heads"] if engine == "vllm" else 1


def counters(servers: list[Any]) -> dict[str, float]:
    """Returns COUNTERS from the servers' /metrics, summed over them (absent ones left out)."""
    out: dict[str, float] = {}
    for s in servers:
        for name, value in scrape(s.url, "kvtier:kv_").items():
            key = name.removeprefix("kvtier:").removesuffix("_total")
            if name.endswith("_total") and key in COUNTERS:
                out[key] = out.get(key, 0.0) + value
    return out


def cache_server_stats(server: CacheServerProcess) -> dict[str, int]:
    """Returns the cache server's STATS counters (entries, bytes, hits, misses, evictions, ...)."""
    client = CacheServerClient("127.0.0.1", server.port)
    try:
        return client.stats()
    finally:
        client.close()


def arm(policy: str, fleet: Fleet, prompts: list[list[int]], max_bytes: int,
        args: argparse.Namespace) -> dict[str, Any]:
    """Runs one arm with fresh processes: the cache server evicting by `policy`, the fleet's
    three servers over it, the kv-aware router; returns its figures."""
    server = CacheServerProcess("--max-bytes", str(max_bytes), "--eviction", policy)
    try:
        t0 = time.perf_counter()
        servers = fleet.start(server.url)
        started = time.perf_counter() - t0
        try:
            router = RouterProcess(*[f"--backend={s.url}" for s in servers], "--policy", "kv-aware")
            try:
                res = asyncio.run(send(router.url, prompts, args.concurrency, args.answer_tokens))
                counts = served_counts(router)
            finally:
                router.stop()
            res["server_counters"] = counters(servers)
        finally:
            fleet.stop(servers)
        res["requests_per_instance"] = [counts.get(s.url, 0.0) for s in servers]
        res["startup_s"] = started
        res["cache_server_stats"] = cache_server_stats(server)
        return res
    finally:
        server.stop()


def part_markdown(engine: str, part: dict[str, Any]) -> list[str]:
    """Returns one engine's section: its workload and a row per eviction policy."""
    w = part["workload"]
    threads = "one OpenMP thread each" if engine == "vllm" else "one thread each"
    extra = (f" vLLM flags: {' '.join(part['engine_flags'])}, fp32, connector chunk_size {w['block_tokens']}; "
             f"the connector stores a chunk as {w['values_per_chunk']} values (one per KV head), which the cache "
             "server evicts one by one." if engine == "vllm" else "")
    dropped = (f" {w['dropped_over_context']} requests of the slice longer than the context left out."
               if w.get("dropped_over_context") else "")
    lines = [f"## {ENGINE_TITLES[engine]}", "",
             f"Requests {w['start']}-{w['start'] + w['requests'] - 1} of Mooncake's {w['trace']} trace, each "
             f"512-token block scaled to {w['block_tokens']} tokens ({w['prompt_tokens']:,} prompt tokens, "
             f"{w['distinct_blocks']:,} distinct blocks), sent in arrival order by {w['concurrency']} clients "
             f"through `kvtier router --policy kv-aware` to {ENGINE_TITLES[engine]} ({threads}, no engine "
             f"prefix cache, chunks of one block) sharing one cache server that holds {w['share']:.0%} of the "
             f"distinct blocks ({w['capacity_blocks']:,}, --max-bytes {w['cache_server_max_bytes']:,}); "
             f"{w['answer_tokens']}-token answers.{dropped}{extra} `replay`: the same "
             f"slice through kvstore/trace_replay.py at the same capacity. One run: {part['date']}.", "",
             "| cache server eviction | hit rate, measured / replay | measured / replay | prompt tokens computed "
             "| TTFT p50 / p90 / p99 | requests/s | requests per instance |",
             "|---|---|---:|---:|---|---:|---|"]
    arms = part["arms"]
    for policy, a in arms.items():
        lines.append(f"| {policy} | {a['hit_rate']:.3f} / {a['replay_hit_rate']:.3f} "
                     f"| {a['hit_rate'] / a['replay_hit_rate']:.3f} | {a['computed_prompt_tokens']:,} "
                     f"| {a['ttft_p50_s']:.2f} / {a['ttft_p90_s']:.2f} / {a['ttft_p99_s']:.2f} s "
                     f"| {a['requests_per_s']:.2f} | {' / '.join(f'{x:.0f}' for x in a['requests_per_instance'])} |")
    if "lru" in arms and len(arms) > 1:
        lines += ["", "Prompt tokens computed, LRU / each other policy: " + "; ".join(
            f"{p} {arms['lru']['computed_prompt_tokens'] / a['computed_prompt_tokens']:.3f}"
            for p, a in arms.items() if p != "lru") + "."]
    if not any("cached_rate" in a for a in arms.values()):
        lines += ["", "Measured hit tokens: `cached_tokens` of each answer's usage as reported (this run predates "
                  "counting a hit that reached the prompt's last token as the whole prompt)."]
    else:
        lines += ["", "Measured hit tokens: `cached_tokens` of each answer's usage, the whole prompt where the hit "
                  "reached its last token (the engine computes that token; the replay counts whole blocks): "
                  + "; ".join(f"{p} {a['hits_to_the_last_token']} such requests, cached / prompt tokens as reported "
                              f"{a['cached_rate']:.3f}" for p, a in arms.items() if "cached_rate" in a) + "."]
    if all("server_counters" in a for a in arms.values()):
        lines += ["", "The servers' own count (`kvtier:kv_connector_hit_tokens`, summed) against the answers' cached "
                  "tokens, and the cache server at the end (entries; bytes held, share of --max-bytes): " + "; ".join(
                      f"{p} {a['server_counters'].get('kv_connector_hit_tokens', 0):,.0f} / "
                      f"{a['cached_rate'] * a['prompt_tokens']:,.0f}, {a['cache_server_stats']['entries']:,} entries, "
                      f"{a['cache_server_stats']['bytes'] / a['cache_server_stats']['max_bytes']:.1%}"
                      for p, a in arms.items()) + "."]
    return lines + [""]


def markdown(res: dict[str, Any]) -> str:
    """Returns the results page: one section per engine run so far."""
    lines = ["# A fleet driven by a production trace (2-core CPU, fp32 SmolLM2-135M)", ""]
    for engine in ENGINE_TITLES:
        if engine in res:
            lines += part_markdown(engine, res[engine])
    return "\n".join(lines)


def previous_results(path: Path) -> dict[str, Any]:
    """Returns the results file at `path` by engine ({} if there is none); a file from before the
    vLLM arm (its arms at the top level) is the kvtier part."""
    if not path.exists():
        return {}
    res: dict[str, Any] = json.loads(path.read_text())
    return {"kvtier": res} if "arms" in res else res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=list(ENGINE_TITLES), default="kvtier",
                    help="the servers (the other engine's arms are kept from the results file)")
    ap.add_argument("--trace", default="conversation", help="a trace under benchmarks/traces/mooncake")
    ap.add_argument("--start", type=int, default=0, help="the slice's first request")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--block-tokens", type=int, default=None,
                    help="tokens per trace block here (and per chunk; default 16, vllm 32: a multiple of 32)")
    ap.add_argument("--share", type=float, default=0.05, help="cache server capacity, share of distinct blocks")
    ap.add_argument("--policies", default="lru,reuse", help=f"cache server eviction policies ({', '.join(POLICIES)})")
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--answer-tokens", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=8192, help="vllm: the context (the default model's)")
    ap.add_argument("--quick", action="store_true", help="60 requests (validates the script)")
    args = ap.parse_args()
    if args.quick:
        args.requests = 60
    vllm = args.engine == "vllm"
    if args.block_tokens is None:
        args.block_tokens = VLLM_BLOCK_MULTIPLE if vllm else 16
    if vllm and args.block_tokens % VLLM_BLOCK_MULTIPLE:
        ap.error(f"--engine vllm: --block-tokens must be a multiple of {VLLM_BLOCK_MULTIPLE} (vLLM's CPU blocks)")
    model = str(ensure_default_model())
    trace = read_trace(TRACES / f"{args.trace}_trace.jsonl.gz")[args.start:args.start + args.requests]
    requests = scaled(trace, args.block_tokens)
    fits = [r for r in requests if not vllm or r.input_length + args.answer_tokens <= args.max_model_len]
    dropped, requests = len(requests) - len(fits), fits
    prompts = [prompt_ids(r) for r in requests]
    distinct = len({b for r in requests for b in r.blocks})
    capacity = max(1, int(distinct * args.share))
    per_token = kv_bytes_per_token(model)  # fp32: both engines run the model in float32
    values = values_per_chunk(model, args.engine)
    max_bytes = capacity * (args.block_tokens * per_token + values * CHUNK_OVERHEAD)
    pool_blocks = max(len(p) for p in prompts) // 16 + 2 + args.answer_tokens // 16 + 1
    workload = {"trace": args.trace, "start": args.start, "requests": len(requests), "block_tokens": args.block_tokens,
                "prompt_tokens": sum(len(p) for p in prompts), "longest_prompt": max(len(p) for p in prompts),
                "dropped_over_context": dropped, "distinct_blocks": distinct, "share": args.share,
                "capacity_blocks": capacity, "values_per_chunk": values, "cache_server_max_bytes": max_bytes,
                "concurrency": args.concurrency, "answer_tokens": args.answer_tokens}
    part: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "workload": workload, "arms": {}}
    with tempfile.TemporaryDirectory(prefix="kvtier-fleet-trace-") as logs:
        if vllm:
            fleet = vllm_fleet(model, args, Path(logs))
            part["engine_flags"] = vllm_flags(args)
        else:
            fleet = kvtier_fleet(model, args, pool_blocks)
            workload["engine_pool_blocks"] = pool_blocks
        for policy in args.policies.split(","):
            replay = plan(requests, [TierSpec(url="kvtier://replay:1", budget=capacity * args.block_tokens * per_token,
                                              eviction=policy)], per_token)
            print(f"fleet ({args.engine}): {policy} (replay: hit rate {replay.hit_rate:.3f}) ...", file=sys.stderr)
            part["arms"][policy] = arm(policy, fleet, prompts, max_bytes, args) | {"replay_hit_rate": replay.hit_rate}
    out = RESULTS / ("fleet_trace_quick" if args.quick else "fleet_trace")
    res = previous_results(out.with_suffix(".json")) | {"quick": args.quick, args.engine: part}
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    md = markdown(res)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
