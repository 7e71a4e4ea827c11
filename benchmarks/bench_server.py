"""Cache server tier vs Redis tier: chunk PUT/GET throughput and small-call latency.

In one run, against a private redis-server and a private `kvtier cache-server` on loopback,
through the kvstore tiers a user configures (`redis://` RedisBackend, `kvtier://`
CacheServerBackend, both with the raw codec): GB/s of batched PUT/GET of real 256-token KV
chunks of the default model, and p50/p99 latency of a one-key EXISTS and a 16-key
PREFIX_HITS. Every figure is also given as a ratio (cache server / Redis, > 1 = the cache
server is better), the only kind of number comparable across machines.

    .venv/bin/python benchmarks/bench_server.py [--quick]

Writes benchmarks/results/server.json and server.md and prints the table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvstore.backend import StorageBackend  # noqa: E402
from kvstore.config import TierSpec  # noqa: E402
from kvstore.keys import process_tokens  # noqa: E402
from kvstore.registry import create_backend  # noqa: E402
from tests.fixtures.cache_server import CacheServerProcess  # noqa: E402
from tests.fixtures.redis_server import start_redis  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
CHUNK = 256


def real_chunks(model_dir: Path, num_chunks: int) -> list[torch.Tensor]:
    """Returns `num_chunks` KV chunks (layers, 2, 256, kv_heads, head_dim) in fp16, computed by
    transformers from the default model on a deterministic token sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    n = num_chunks * CHUNK
    ids = (torch.arange(n, dtype=torch.long) * 7919 % (model.config.vocab_size - 1) + 1).unsqueeze(0)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    cache = out.past_key_values
    layers = [(cache.layers[i].keys, cache.layers[i].values) for i in range(len(cache.layers))] \
        if hasattr(cache, "layers") else [(k, v) for k, v in cache]
    # (layers, 2, heads, tokens, dim) -> (layers, 2, tokens, heads, dim)
    kv = torch.stack([torch.stack([k[0], v[0]]) for k, v in layers]).transpose(2, 3).to(torch.float16)
    return [kv[:, :, i * CHUNK : (i + 1) * CHUNK].contiguous() for i in range(num_chunks)]


def _keys(num: int, salt: int) -> list[str]:
    tokens = [salt * 1_000_003 + i for i in range(num * CHUNK)]
    return [k.to_str() for _, _, k in process_tokens(tokens, CHUNK, model="bench", kv_dtype="float16")]


def throughput(tier: StorageBackend, chunks: list[torch.Tensor], rounds: int) -> dict[str, float]:
    """Returns median GB/s of batched_put and batched_get of all chunks, over `rounds` rounds
    (fresh keys every round, so PUTs never just overwrite)."""
    nbytes = sum(c.numel() * c.element_size() for c in chunks)
    put_s, get_s = [], []
    for r in range(rounds):
        keys = _keys(len(chunks), r)
        items = list(zip(keys, chunks))
        t0 = time.perf_counter()
        tier.batched_put(items)
        put_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = tier.batched_get(keys)
        get_s.append(time.perf_counter() - t0)
        if any(g is None or not torch.equal(g, c) for g, c in zip(got, chunks)):
            raise RuntimeError(f"{tier.name}: a chunk did not round-trip")
        for key in keys:
            tier.delete(key)
    return {"put_gbps": nbytes / statistics.median(put_s) / 1e9,
            "get_gbps": nbytes / statistics.median(get_s) / 1e9}


def latencies(fn: Callable[[], object], calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds, to check the script works")
    parser.add_argument("--model", type=Path, default=None, help="HF checkpoint dir (default: the default model)")
    args = parser.parse_args(argv)
    # blocks alternate the tiers; each block runs `rounds` throughput rounds and `calls` small calls
    num_chunks, blocks, rounds, calls = (4, 3, 2, 100) if args.quick else (8, 6, 3, 500)

    if args.model is None:
        from engine.default_model import ensure_default_model

        args.model = ensure_default_model()
    print(f"computing {num_chunks} real KV chunks with {args.model} ...", flush=True)
    chunks = real_chunks(args.model, num_chunks)
    chunk_mb = chunks[0].numel() * chunks[0].element_size() / 1e6

    redis = start_redis()
    server = CacheServerProcess("--max-bytes", "2GiB")
    tiers: dict[str, StorageBackend] = {}
    try:
        tiers = {
            "kvtier": create_backend(TierSpec.from_url(server.url)),
            "redis": create_backend(TierSpec.from_url(redis.url)),
        }
        raw: dict[str, dict[str, list[float]]] = {n: {"put": [], "get": [], "exists": [], "prefix": []} for n in tiers}
        for tier in tiers.values():  # warm up: connections, allocator, page cache
            throughput(tier, chunks, 1)
        # Interleave the two tiers block by block, alternating which goes first, so machine
        # noise (these machines are shared) hits both alike.
        for b in range(blocks):
            for name in (list(tiers) if b % 2 == 0 else list(tiers)[::-1]):
                tier = tiers[name]
                t = throughput(tier, chunks, rounds)
                raw[name]["put"].append(t["put_gbps"])
                raw[name]["get"].append(t["get_gbps"])
                present = _keys(8, 999)
                tier.batched_put([(k, chunks[0][:1, :, :16].contiguous()) for k in present])
                probe = present + _keys(8, 998)  # 8 present, then 8 absent
                raw[name]["exists"] += latencies(lambda: tier.contains(present[0]), calls)
                raw[name]["prefix"] += latencies(lambda: tier.prefix_hits(probe), calls)
                assert tier.prefix_hits(probe) == 8
                tier.clear()
    finally:
        for tier in tiers.values():
            tier.close()
        server.stop()
        redis.stop()

    rows = []
    for metric, unit, better in [("put", "GB/s", "higher"), ("get", "GB/s", "higher"),
                                 ("exists", "µs", "lower"), ("prefix", "µs", "lower")]:
        if unit == "GB/s":
            stats = {n: {"value": statistics.median(raw[n][metric])} for n in tiers}
            ratio = stats["kvtier"]["value"] / stats["redis"]["value"]
            rows.append({"metric": f"{metric.upper()} 256-token chunk", "unit": unit,
                         "kvtier": stats["kvtier"]["value"], "redis": stats["redis"]["value"], "ratio": ratio})
        else:
            label = "EXISTS (1 key)" if metric == "exists" else "PREFIX_HITS (16 keys)"
            for q in (0.5, 0.99):
                a, b = _pct(raw["kvtier"][metric], q), _pct(raw["redis"][metric], q)
                rows.append({"metric": f"{label} p{int(q * 100)}", "unit": unit, "kvtier": a, "redis": b,
                             "ratio": b / a})

    result = {
        "benchmark": "server",
        "quick": args.quick,
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "torch_threads": torch.get_num_threads()},
        "setup": {"chunk_tokens": CHUNK, "chunk_mb": round(chunk_mb, 3), "chunks_per_batch": num_chunks,
                  "blocks": blocks, "rounds_per_block": rounds, "latency_calls_per_block": calls,
                  "codec": "raw",
                  "redis": "private redis-server via kvstore RedisBackend (redis-py + hiredis, pipelined)",
                  "kvtier": "private kvtier cache-server via kvstore CacheServerBackend"},
        "ratio_meaning": "kvtier over redis: throughput kvtier/redis, latency redis/kvtier (>1 = kvtier better)",
        "rows": rows,
    }
    lines = ["| metric | unit | kvtier cache server | Redis | ratio (>1: cache server better) |",
             "|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['metric']} | {r['unit']} | {r['kvtier']:.2f} | {r['redis']:.2f} | {r['ratio']:.2f}x |")
    table = "\n".join(lines)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "server.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "server.md").write_text(
        f"# bench_server{' (quick)' if args.quick else ''}\n\n"
        f"{num_chunks} chunks of {chunk_mb:.2f} MB per batch (real KV of the default model, raw codec), "
        f"loopback, one client thread.\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
