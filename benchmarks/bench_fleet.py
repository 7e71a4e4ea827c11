"""A fleet sharing one cache: three engines over one cache server or one Redis against the same
three with only their own cpu tier, behind `kvtier router --policy kv-aware`; ratios in one run.

Workload (documents that recur across instances): D long documents (~1.5k tokens), read by S
users in all; each user is a multi-turn chat over one document (the document as the system
message, T questions in a row, the history growing). Document popularity is Zipf-like (a
few documents draw most users; `--popularity uniform`: every document the same number), and
users of one document arrive spread over the run. Closed
loop: C users at a time, each running its turns back to back; the next user starts when one
ends. Every arm runs the same users in the same order.

Part 1, `kvtier serve` (`--engine kvtier`): three instances on this 2-core machine, one thread
each (OMP_NUM_THREADS=1), each with a small engine KV pool and a `cpu` tier of a few documents.
Arms, each with fresh processes:
  isolated              each instance its own cpu tier only;
  shared cache server   cpu tier + one `kvtier cache-server` (one copy of each chunk, fleet-wide);
  shared Redis          cpu tier + one private redis-server;
  isolated, affinity-first router: isolated, router at its default --balance-threshold 16,
                        which at this scale never balances (every repeat goes where the
                        document's KV is): the isolated fleet's best case for hits.
The first three use one router setting, `--balance-threshold` (default 1: an instance more
than one request busier than the least loaded ranks last), so the router balances load and a
document's later users may land on an instance that never saw it; the affinity-first arm is
the other end of that trade, and the headline ratio is over the better of the two isolated
arms. Per arm: requests/s, output and prompt tokens/s over the arm's wall time, TTFT
p50/p90/p99 (every request, client side), requests per instance. Target (issue #50): shared
throughput >= 1.5x isolated at the same TTFT bound (LMCache's CPU RFC reports +31%). A
closed loop at a fixed concurrency gives each arm one (throughput, TTFT) point; where the
shared arm's TTFT percentiles are all at or under the isolated arm's, the shared fleet meets
the isolated fleet's TTFT bound at its measured throughput, so the ratio of the two
throughputs holds "at the same TTFT bound" (taking the isolated arm's own percentiles as the
bound). The ratio table says whether that holds.

Part 2, pin and prefetch: one `kvtier serve` (both threads) with a small `cpu` tier; two
documents are pinned with `POST /kv/pin` (operator key), two are not; a flood of other
documents then passes through the tier; TTFT of a new question on each document after the
flood. Twice: cpu tier only (unpinned: recomputed), and cpu + a cache server (unpinned:
loaded from the server), where two more documents are brought back into cpu after the flood
with `POST /kv/prefetch` when the server has it (else the table records a TODO).

Part 3, `vllm serve` (`--engine vllm`, from .venv-vllm through `kvtier-vllm serve`, which
adds the `/kv/lookup` route the router asks): three servers with kvtier's connector, isolated
(`cpu` tier) vs one shared cache server (and Redis with `--vllm-arms`), same workload and
router. Each server one OpenMP thread: VLLM_CPU_OMP_THREADS_BIND 0, 1, 0 (two on core 0),
VLLM_CPU_KVCACHE_SPACE=2 and `--num-gpu-blocks-override` sized as kvtier's engine pool (at
least one --max-model-len sequence).

    .venv/bin/python -m benchmarks.bench_fleet [--quick] [--engine kvtier|vllm] [--docs 12]
        [--users 36] [--turns 2] [--concurrency 6] [--doc-tokens 1500] [--no-pin]

Writes benchmarks/results/<--out, default fleet>.json and .md (each engine's part kept from the existing
file when the other runs) and prints the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from benchmarks.bench_router import ONE_THREAD, served_counts, start_servers
from benchmarks.bench_serving import QUESTIONS, chat_stream, context_text, pct, ratio_rows
from engine.default_model import ensure_default_model
from harness.cache_server import CacheServerProcess
from harness.redis import RedisServer, start_redis
from harness.serve import RouterProcess, ServeProcess

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
OPERATOR_KEY = "bench-fleet-operator"
CHUNK = 256
VLLM_BLOCK = 128  # vLLM's CPU build's default block size
VLLM_BINDS = ("0", "1", "0")  # one OpenMP thread per vllm serve, three on two cores
# name -> (shared tier: None, "server" or "redis"; router balance threshold, None: --balance-threshold)
ARMS: dict[str, tuple[str | None, int | None]] = {
    "isolated": (None, None),
    "shared cache server": ("server", None),
    "shared Redis": ("redis", None),
    "isolated, affinity-first router": (None, 16),
}


def kv_bytes_per_token(model: str) -> int:
    """Returns the fp32 K/V bytes one token takes in the model (all layers, K and V)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head * 4


def plan_users(docs: int, users: int, seed: int, popularity: str = "zipf") -> list[int]:
    """Returns each user's document: Zipf-like counts (weight 1/rank, every document at least
    one user) or, `popularity` "uniform", as even as `users` allows, in a seeded order that
    spreads a document's users over the run."""
    weights = [1 / (d + 1) if popularity == "zipf" else 1.0 for d in range(docs)]
    counts = [1] * docs
    for _ in range(users - docs):  # largest remainder: give the next user to the most under-served
        d = max(range(docs), key=lambda i: weights[i] / sum(weights) * users - counts[i])
        counts[d] += 1
    order = [d for d, n in enumerate(counts) for _ in range(n)]
    random.Random(seed).shuffle(order)
    return order


async def run_fleet(url: str, docs: list[str], plan: list[int], turns: int, concurrency: int,
                    answer_tokens: int) -> dict[str, Any]:
    """Runs every user of `plan` (C at a time, each its turns back to back); returns the arm's
    throughput and TTFT figures."""
    records: list[dict[str, Any]] = []
    todo = list(enumerate(plan))
    async with httpx.AsyncClient(base_url=url, timeout=1200) as client:
        async def worker() -> None:
            while todo:
                user, doc = todo.pop(0)
                history = [{"role": "system", "content": docs[doc]}]
                for turn in range(turns):
                    history.append({"role": "user", "content": QUESTIONS[(user + turn) % len(QUESTIONS)]})
                    res = await chat_stream(client, history, answer_tokens)
                    history.append({"role": "assistant", "content": res["text"]})
                    usage = res["usage"]
                    records.append({"user": user, "doc": doc, "turn": turn, "ttft": res["ttft"], "gaps": res["gaps"],
                                    "prompt_tokens": usage["prompt_tokens"],
                                    "cached_tokens": cached_tokens(usage),
                                    "completion_tokens": usage["completion_tokens"]})

        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return summarise(records, wall) | {"loadavg_1m_start": load0, "loadavg_1m_end": os.getloadavg()[0]}


def cached_tokens(usage: dict[str, Any]) -> int:
    """Returns the usage's cached prompt tokens (0 where the server leaves the details out)."""
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def summarise(records: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    ttfts = [r["ttft"] for r in records]
    gaps = [g for r in records for g in r["gaps"]]
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    # a request is "cold" if under half its prompt came from a cache (engine or tier)
    cold = sum(1 for r in records if r["cached_tokens"] < r["prompt_tokens"] / 2)
    return {"requests": len(records), "wall_s": wall, "requests_per_s": len(records) / wall,
            "output_tok_s": sum(r["completion_tokens"] for r in records) / wall,
            "prompt_tok_s": prompt / wall, "computed_prompt_tokens": prompt - cached,
            "cached_share": cached / prompt, "cold_requests": cold,
            "ttft_mean_s": statistics.mean(ttfts), "ttft_p50_s": pct(ttfts, 50), "ttft_p90_s": pct(ttfts, 90),
            "ttft_p99_s": pct(ttfts, 99), "itl_p50_s": pct(gaps, 50), "itl_p99_s": pct(gaps, 99),
            "per_request": [{k: v for k, v in r.items() if k != "gaps"} for r in records]}


def shared_tier(kind: str | None, cache_bytes: str) -> CacheServerProcess | RedisServer | None:
    if kind == "server":
        return CacheServerProcess("--max-bytes", cache_bytes)
    if kind == "redis":
        return start_redis()
    return None


def fleet_arm(arm: str, start: Callable[[list[str]], list[Any]], stop: Callable[[list[Any]], None],
              tiers: Callable[[str | None], list[str]], docs: list[str], plan: list[int],
              args: argparse.Namespace) -> dict[str, Any]:
    """Runs one arm with fresh processes: the shared tier (if any), three engines started by
    `start` (given each one's tier URLs) and stopped by `stop`, the kv-aware router; returns
    the arm's figures."""
    kind, threshold = ARMS[arm]
    shared = shared_tier(kind, args.cache_bytes)
    try:
        t0 = time.perf_counter()
        servers = start(tiers(shared.url if shared else None))
        started = time.perf_counter() - t0
        try:
            router = RouterProcess(*[f"--backend={s.url}" for s in servers], "--policy", "kv-aware",
                                   "--balance-threshold",
                                   str(args.balance_threshold if threshold is None else threshold),
                                   "--lookup-timeout", str(args.lookup_timeout))
            try:
                res = asyncio.run(run_fleet(router.url, docs, plan, args.turns, args.concurrency,
                                            args.answer_tokens))
                counts = served_counts(router)
            finally:
                router.stop()
        finally:
            stop(servers)
        res["requests_per_instance"] = [counts.get(s.url, 0.0) for s in servers]
        res["startup_s"] = started
        return res
    finally:
        if shared is not None:
            shared.stop()


def stop_servers(servers: list[ServeProcess]) -> None:
    for s in servers:
        s.stop()


def kvtier_fleet(model: str, docs: list[str], plan: list[int], args: argparse.Namespace,
                 per_doc: int, blocks: int) -> dict[str, Any]:
    engine = ["--model", model, "--device", "cpu", "--num-gpu-blocks", str(blocks),
              "--max-num-seqs", str(args.max_num_seqs)]
    cpu = f"cpu?budget={args.cpu_docs * per_doc}"

    def tiers(url: str | None) -> list[str]:
        return ["--kv-tier", cpu, *(["--kv-tier", url] if url else [])]

    out: dict[str, Any] = {}
    for arm in args.arms:
        print(f"kvtier fleet: {arm} ...", file=sys.stderr)
        out[arm] = fleet_arm(arm, lambda t: start_servers([engine + t] * 3), stop_servers, tiers, docs, plan, args)
    return out


def start_vllm_fleet(model: str, config: dict[str, Any], flags: list[str], logs: Path) -> list[Any]:
    """Returns three ready `kvtier-vllm serve` (bench_serving_vs_vllm.vllm_serve: .venv-vllm,
    VLLM_CPU_KVCACHE_SPACE 2) with kvtier's connector configured by `config` and vLLM's engine
    flags `flags`, one OpenMP thread each (VLLM_BINDS), started side by side; their logs
    `logs/vllm<i>.log`. Close them with harness.vllm.close_together."""
    from benchmarks.bench_serving_vs_vllm import vllm_serve
    from harness.vllm import start_together

    return start_together(*(
        (lambda i=i: vllm_serve(Path(model), logs / f"vllm{i}.log", config, flags,
                                env={"VLLM_CPU_OMP_THREADS_BIND": VLLM_BINDS[i]}))
        for i in range(len(VLLM_BINDS))))


def vllm_fleet(model: str, docs: list[str], plan: list[int], args: argparse.Namespace,
               per_doc: int, blocks: int, logs: Path) -> dict[str, Any]:
    from benchmarks.bench_serving_vs_vllm import NAME
    from harness.vllm import close_together

    flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "4096", "--enable-prompt-tokens-details",
             "--num-gpu-blocks-override", str(max(4096 // VLLM_BLOCK, blocks * 16 // VLLM_BLOCK))]

    def tiers(url: str | None) -> list[str]:
        return [f"cpu?budget={args.cpu_docs * per_doc}", *([url] if url else [])]

    def start(t: list[str]) -> list[Any]:
        return start_vllm_fleet(model, {"tiers": t, "chunk_size": CHUNK}, flags, logs)

    out: dict[str, Any] = {"served_model_name": NAME, "thread_binds": list(VLLM_BINDS), "engine_flags": flags}
    for arm in args.vllm_arms:
        print(f"vllm fleet: {arm} ...", file=sys.stderr)
        out[arm] = fleet_arm(arm, start, lambda servers: close_together(*servers), tiers, docs, plan, args)
    return out


PREFETCH = "/kv/prefetch"  # POST: a prompt and the `tier` to fill from the slower tiers (operator key)


def doc_chat(doc: str, question: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": doc}, {"role": "user", "content": QUESTIONS[question]}]


async def pin_run(url: str, groups: dict[str, list[str]], flood: list[str], answer_tokens: int) -> dict[str, Any]:
    """Asks every document of every group once (cold; its chunks are stored), pinning each of
    the `pinned` group's in the cpu tier just after, sends the `flood` through, prefetches
    the `prefetched` group's back into the cpu tier, then asks each document a new question,
    the groups interleaved; returns the TTFTs and what each tier held before the questions."""
    async with httpx.AsyncClient(base_url=url, timeout=1200,
                                 headers={"Authorization": f"Bearer {OPERATOR_KEY}"}) as client:
        cold, pins = [], []
        for name, docs in groups.items():
            for d in docs:
                cold.append((await chat_stream(client, doc_chat(d, 0), answer_tokens))["ttft"])
                if name != "pinned":
                    continue
                for _ in range(100):  # the cpu tier's store lands just after the answer: retry briefly
                    r = await client.post("/kv/pin", json={"messages": doc_chat(d, 0), "tier": "cpu"})
                    if r.status_code != 409:
                        break
                    await asyncio.sleep(0.1)
                r.raise_for_status()
                pins.append(r.json())
        for d in flood:
            await chat_stream(client, doc_chat(d, 0), answer_tokens)
        prefetches = []
        for d in groups.get("prefetched", []):
            r = await client.post(PREFETCH, json={"messages": doc_chat(d, 0), "tier": "cpu"})
            r.raise_for_status()
            prefetches.append(r.json())
        held: dict[str, list[dict[str, Any]]] = {}
        for name, docs in groups.items():
            for d in docs:
                r = await client.post("/kv/lookup", json={"messages": doc_chat(d, 1)})
                held.setdefault(name, []).append({k: v for k, v in r.json().items() if k in ("tiers", "max_hit_tokens",
                                                                                            "engine_prefix_cache_tokens")})
        after: dict[str, list[dict[str, Any]]] = {name: [] for name in groups}
        for i in range(max(len(docs) for docs in groups.values())):  # interleaved: all see the same machine
            for name, docs in groups.items():
                res = await chat_stream(client, doc_chat(docs[i], 1), answer_tokens)
                after[name].append({"ttft_s": res["ttft"], "cached_tokens": cached_tokens(res["usage"]),
                                    "prompt_tokens": res["usage"]["prompt_tokens"]})
    return {"cold_ttft_s": cold, "pins": pins, "prefetches": prefetches, "held_before_questions": held,
            "after_flood": after, "mean_ttft_s": {name: statistics.mean(x["ttft_s"] for x in rows)
                                                  for name, rows in after.items()}}


def pin_effect(model: str, tok: Any, args: argparse.Namespace, per_doc: int) -> dict[str, Any]:
    """Part 2, two configurations, each one fresh `kvtier serve` (both threads) with a cpu tier of
    `2 * pin_docs + 1` documents (pin budget `pin_docs + 1`) and an engine pool of two documents,
    and a flood of `flood_docs` documents (see pin_run):
    `cpu only`: pinned vs unpinned (a pinned document is a cpu hit, an unpinned one recomputed);
    `cpu + cache server`: pinned vs unpinned (loaded from the cache server) vs prefetched back
    into cpu after the flood (when the server has POST /kv/prefetch; else a TODO is recorded)."""
    n = args.pin_docs
    flood = [context_text(300 + i, tok, args.doc_tokens) for i in range(args.flood_docs)]
    budget, pin_budget = (2 * n + 1) * per_doc, (n + 1) * per_doc
    blocks = 2 * (args.doc_tokens + 200) // 16 + 16  # two documents: the flood evicts the rest
    out: dict[str, Any] = {"pin_docs": n, "flood_docs": args.flood_docs, "cpu_budget_bytes": budget,
                           "pin_budget_bytes": pin_budget, "num_gpu_blocks": blocks, "threads": "both cores"}
    for config, base in (("cpu only", 200), ("cpu + cache server", 240)):
        groups = {name: [context_text(base + 10 * g + i, tok, args.doc_tokens) for i in range(n)]
                  for g, name in enumerate(("pinned", "unpinned", "prefetched"))}
        cache = CacheServerProcess("--max-bytes", args.cache_bytes) if config != "cpu only" else None
        tiers = ["--kv-tier", f"cpu?budget={budget}&pin_budget={pin_budget}",
                 *(["--kv-tier", cache.url] if cache else [])]
        try:
            server = ServeProcess("--model", model, "--device", "cpu", "--num-gpu-blocks", str(blocks),
                                  "--max-num-seqs", "1", *tiers, "--api-key", OPERATOR_KEY)
            try:
                has_prefetch = httpx.post(server.url + PREFETCH, json={}, timeout=30,
                                          headers={"Authorization": f"Bearer {OPERATOR_KEY}"}).status_code != 404
                if cache is None or not has_prefetch:
                    del groups["prefetched"]
                print(f"pin: {config} ...", file=sys.stderr)
                out[config] = asyncio.run(pin_run(server.url, groups, flood, args.answer_tokens))
                out[config]["prefetch_route"] = has_prefetch
            finally:
                server.stop()
        finally:
            if cache is not None:
                cache.stop()
    return out


def ratios(part: dict[str, Any]) -> dict[str, tuple[float, str]]:
    """Returns each shared arm's throughput over each isolated arm's, whether its TTFT
    percentiles are all at or under that arm's (the same TTFT bound met), and its throughput
    over the better isolated arm's (the headline)."""
    out: dict[str, tuple[float, str]] = {}
    isolated = [a for a in ("isolated", "isolated, affinity-first router") if a in part]
    for arm in ("shared cache server", "shared Redis"):
        sh = part.get(arm)
        if sh is None or not isolated:
            continue
        for iso_name in isolated:
            iso = part[iso_name]
            within = all(sh[f"ttft_p{q}_s"] <= iso[f"ttft_p{q}_s"] for q in (50, 90, 99))
            out[f"requests/s, {arm} / {iso_name}"] = (sh["requests_per_s"] / iso["requests_per_s"], "reported")
            out[f"prompt tokens computed, {iso_name} / {arm}"] = (
                iso["computed_prompt_tokens"] / sh["computed_prompt_tokens"], "reported")
            out[f"{arm}: TTFT p50, p90, p99 all <= {iso_name}'s (same bound)"] = (float(within), "1")
        best = max(isolated, key=lambda a: part[a]["requests_per_s"])
        out[f"requests/s, {arm} / the better isolated arm ({best})"] = (
            sh["requests_per_s"] / part[best]["requests_per_s"], ">= 1.5 at the same TTFT bound")
    return out


def table(part: dict[str, Any]) -> str:
    lines = ["| arm | requests/s | out tok/s | prompt tok/s | TTFT p50 / p90 / p99 | TTFT mean | ITL p50 / p99 | "
             "cached share | prompt tokens computed | cold requests | requests per instance | wall |",
             "|---|---:|---:|---:|---|---:|---|---:|---:|---:|---|---:|"]
    for arm, a in part.items():
        if not isinstance(a, dict) or "requests_per_s" not in a:
            continue
        lines.append(f"| {arm} | {a['requests_per_s']:.3f} | {a['output_tok_s']:.2f} | {a['prompt_tok_s']:.0f} | "
                     f"{a['ttft_p50_s']:.2f} / {a['ttft_p90_s']:.2f} / {a['ttft_p99_s']:.2f} s | "
                     f"{a['ttft_mean_s']:.2f} s | "
                     f"{a['itl_p50_s'] * 1e3:.0f} / {a['itl_p99_s'] * 1e3:.0f} ms | {a['cached_share']:.2f} | "
                     f"{a['computed_prompt_tokens']} | "
                     f"{a['cold_requests']} of {a['requests']} | "
                     f"{' / '.join(f'{x:.0f}' for x in a['requests_per_instance'])} | {a['wall_s']:.0f} s |")
    return "\n".join(lines + ratio_rows(ratios(part)))


def pin_table(p: dict[str, Any]) -> str:
    rows = ["| tiers | document | TTFT after the flood (each) | mean | cached / prompt tokens | tier hit before |",
            "|---|---|---|---:|---|---|"]
    found: dict[str, tuple[float, str]] = {}
    todo = ""
    for config in ("cpu only", "cpu + cache server"):
        c = p.get(config)
        if c is None:
            continue
        for name, w in c["after_flood"].items():
            each = ", ".join(f"{x['ttft_s']:.2f}" for x in w)
            tokens = ", ".join(f"{x['cached_tokens']}/{x['prompt_tokens']}" for x in w)
            rows.append(f"| {config} | {name} | {each} s | {c['mean_ttft_s'][name]:.2f} s | {tokens} | "
                        f"{', '.join(str(h['max_hit_tokens']) for h in c['held_before_questions'][name])} |")
        m = c["mean_ttft_s"]
        found[f"{config}: mean TTFT after the flood, unpinned / pinned"] = (m["unpinned"] / m["pinned"], "reported")
        if "prefetched" in m:
            found[f"{config}: mean TTFT after the flood, unpinned / prefetched"] = (m["unpinned"] / m["prefetched"],
                                                                                  "reported")
        elif config != "cpu only":
            todo = ("\n\nPrefetch: not measured, this build has no `POST /kv/prefetch` (TODO: the `prefetched` "
                    "group of `pin_effect` runs once the route is there).")
        found[f"{config}: cold TTFT (first request, mean) / pinned after the flood"] = (
            statistics.mean(c["cold_ttft_s"]) / m["pinned"], "reported")
    return "\n".join(rows + ratio_rows(found)) + todo


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (validates the script)")
    ap.add_argument("--engine", choices=["kvtier", "vllm"], default="kvtier",
                    help="kvtier: parts 1 and 2; vllm: part 3 (the other parts are kept from the results file)")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the bundled model)")
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--users", type=int, default=36, help="chats in all (each over one document)")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=6, help="users at a time (closed loop)")
    ap.add_argument("--doc-tokens", type=int, default=1500)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--cpu-docs", type=int, default=2, help="each instance's cpu tier holds this many documents")
    ap.add_argument("--cache-bytes", default="4GiB", help="the cache server's --max-bytes")
    ap.add_argument("--balance-threshold", type=int, default=1, help="the router's, in the main arms")
    ap.add_argument("--lookup-timeout", type=float, default=2.0, help="the router's (s)")
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    ap.add_argument("--vllm-arms", nargs="+", choices=list(ARMS), default=["isolated", "shared cache server"])
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--pin-docs", type=int, default=2)
    ap.add_argument("--flood-docs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--popularity", choices=["zipf", "uniform"], default="zipf",
                    help="users per document: Zipf-like (a few documents draw most) or even (every one recurs)")
    ap.add_argument("--out", default="fleet", help="results file name under benchmarks/results (no suffix)")
    args = ap.parse_args()
    if args.quick:
        args.docs, args.users, args.turns, args.concurrency, args.doc_tokens = 3, 6, 2, 3, 300
        args.answer_tokens, args.max_num_seqs, args.cpu_docs, args.pin_docs, args.flood_docs = 8, 2, 2, 1, 4
    model = args.model or str(ensure_default_model())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    docs = [context_text(100 + d, tok, args.doc_tokens) for d in range(args.docs)]
    plan = plan_users(args.docs, args.users, args.seed, args.popularity)
    per_doc = kv_bytes_per_token(model) * (args.doc_tokens + 100)
    per_request_blocks = (args.doc_tokens + args.turns * (args.answer_tokens + 40)) // 16 + 8
    blocks = per_request_blocks * args.max_num_seqs + per_request_blocks // 2  # the running requests and a little more
    suffix = "_quick" if args.quick else ""
    previous = RESULTS / f"{args.out}{suffix}.json"
    res: dict[str, Any] = json.loads(previous.read_text()) if previous.exists() else {}
    workload = {"docs": args.docs, "users": args.users, "turns": args.turns, "concurrency": args.concurrency,
                "doc_tokens": args.doc_tokens, "answer_tokens": args.answer_tokens, "users_per_doc":
                [plan.count(d) for d in range(args.docs)], "max_num_seqs": args.max_num_seqs,
                "engine_pool_blocks": blocks, "cpu_tier_docs": args.cpu_docs, "cpu_tier_bytes": args.cpu_docs * per_doc,
                "cache_server_bytes": args.cache_bytes, "balance_threshold": args.balance_threshold,
                "lookup_timeout_s": args.lookup_timeout, "seed": args.seed, "popularity": args.popularity}
    res.update({"quick": args.quick, "platform": platform.platform()})
    if args.engine == "kvtier":
        res["kvtier"] = {"workload": workload, "threads_per_instance": 1, "env": ONE_THREAD,
                         "arms": kvtier_fleet(model, docs, plan, args, per_doc, blocks)}
        if not args.no_pin:
            print("pin ...", file=sys.stderr)
            res["pin"] = pin_effect(model, tok, args, per_doc)
    else:
        with tempfile.TemporaryDirectory(prefix="kvtier-fleet-vllm-") as logs:
            arms = vllm_fleet(model, docs, plan, args, per_doc, blocks, Path(logs))
        res["vllm"] = {"workload": workload, **{k: arms.pop(k) for k in ("served_model_name", "thread_binds",
                                                                          "engine_flags")}, "arms": arms}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}{suffix}.json").write_text(json.dumps(res, indent=2) + "\n")
    md = markdown(res)
    (RESULTS / f"{args.out}{suffix}.md").write_text(md)
    print(md)
    return 0


def markdown(res: dict[str, Any]) -> str:
    parts = ["# A fleet sharing one cache: three engines, kv-aware router (2-core CPU, fp32 SmolLM2-135M)", ""]
    for engine, title in (("kvtier", "`kvtier serve` x 3, one thread each"),
                          ("vllm", "`vllm serve` + kvtier's connector x 3, one OpenMP thread each")):
        part = res.get(engine)
        if not part:
            continue
        w = part["workload"]
        parts += [f"## {title}", "",
                  f"{w['docs']} documents of ~{w['doc_tokens']} tokens, {w['users']} chats of {w['turns']} turns "
                  f"(users per document {w['users_per_doc']}), {w['concurrency']} chats at a time, "
                  f"{w['answer_tokens']}-token answers; per instance {w['engine_pool_blocks']} KV blocks of 16 tokens "
                  f"and a cpu tier of {w['cpu_tier_docs']} documents ({w['cpu_tier_bytes'] / 2**20:.0f} MiB); "
                  f"cache server --max-bytes {w['cache_server_bytes']}; router kv-aware, --balance-threshold "
                  f"{w['balance_threshold']} (the affinity-first arm: 16), --lookup-timeout {w['lookup_timeout_s']:g}."
                  + (f" vLLM: thread binds {part['thread_binds']}, flags {' '.join(part['engine_flags'])}."
                     if engine == "vllm" else ""), "", table(part["arms"]), "",
                  "1-minute load average at each arm's start and end (it counts the fleet's own processes): "
                  + "; ".join(f"{arm} {a['loadavg_1m_start']:.1f} -> {a['loadavg_1m_end']:.1f}"
                              for arm, a in part["arms"].items()) + ".", ""]
    if "pin" in res:
        p = res["pin"]
        parts += ["## Pin and prefetch under eviction pressure (one `kvtier serve`, both threads)", "",
                  f"cpu tier {p['cpu_budget_bytes'] / 2**20:.0f} MiB (pin budget "
                  f"{p['pin_budget_bytes'] / 2**20:.0f} MiB), engine pool {p['num_gpu_blocks']} blocks; "
                  f"{p['pin_docs']} documents per group asked once (stored), the pinned group pinned in cpu, then "
                  f"{p['flood_docs']} other documents, the prefetched group prefetched into cpu, then one new "
                  "question on each document.", "", pin_table(p), ""]
    return "\n".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
