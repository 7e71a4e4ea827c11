"""Cache server tier vs Redis tier: chunk PUT/GET throughput and small-call latency.

In one run, against a private redis-server and a private `kvtier cache-server` on loopback,
through the kvstore tiers a user configures (`redis://` RedisBackend, `kvtier://`
CacheServerBackend, both with the raw codec): GB/s of batched PUT/GET of real 256-token KV
chunks of the default model (through the tier API, and on the wire: the tiers' byte-level
hooks on pre-encoded values, which isolates transport and server), and p50/p99 latency of a one-key EXISTS and a 16-key
PREFIX_HITS. Every figure is also given as a ratio (cache server / Redis, > 1 = the cache
server is better), the only kind of number comparable across machines.

    .venv/bin/python -m benchmarks.bench_server [--quick]

Writes benchmarks/results/server.json and server.md (server_quick.* with --quick) and prints
the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from harness.cache_server import CacheServerProcess
from harness.redis import start_redis
from kvkeys.keyspace import Keyspace
from kvstore import serde
from kvstore.backend import BytesBackend, leading_run
from kvstore.registry import create_backend
from kvstore.store_config import TierSpec

REPO = Path(__file__).resolve().parents[1]

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
    return [sp.key for sp in Keyspace("bench", "float16", CHUNK, num_layers=1).spans(tokens)]


def server_cpu_s(pid: int) -> float:
    """Returns the CPU seconds (user + system) process `pid` has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def throughput(tier: BytesBackend, server_pid: int, chunks: list[torch.Tensor], rounds: int) -> dict[str, list[float]]:
    """Returns per-round GB/s of: `put`/`get` (tier API: batched_put/batched_get of all chunks,
    serde encode/decode included) and `put_wire`/`get_wire` (the tier's byte-level batched
    hooks on pre-encoded values: the transport and the server alone), plus the server
    process's CPU seconds per GB in the wire phases (`*_cpu`: robust to a busy machine, where
    wall-clock figures mostly measure the scheduler). Fresh keys every round, so PUTs never
    just overwrite; every chunk is checked to round-trip."""
    nbytes = sum(c.numel() * c.element_size() for c in chunks)
    out: dict[str, list[float]] = {
        m: [] for m in ("put", "get", "put_wire", "get_wire", "put_wire_cpu", "get_wire_cpu")
    }

    def timed(metric: str, fn: Callable[[], object]) -> object:
        c0, t0 = server_cpu_s(server_pid), time.perf_counter()
        result = fn()
        out[metric].append(nbytes / (time.perf_counter() - t0) / 1e9)
        if metric.endswith("_wire"):
            out[metric + "_cpu"].append((server_cpu_s(server_pid) - c0) / (nbytes / 1e9))
        return result

    for r in range(rounds):
        keys = _keys(len(chunks), 2 * r)
        timed("put", partial(tier.batched_put, list(zip(keys, chunks))))
        got = timed("get", partial(tier.batched_get, keys))
        if any(g is None or not torch.equal(g, c) for g, c in zip(got, chunks)):
            raise RuntimeError(f"{tier.name}: a chunk did not round-trip")
        wire_keys = _keys(len(chunks), 2 * r + 1)
        values = [(k, tier._encode(k, c)) for k, c in zip(wire_keys, chunks)]
        timed("put_wire", partial(tier._batched_put_bytes, values))
        raw = timed("get_wire", partial(tier._batched_get_bytes, wire_keys))
        raw = [v.value if isinstance(v, serde.CheckedValue) else v for v in raw]  # checked as they arrived
        if [bytes(v) for v in raw] != [bytes(serde.encode(k, c, tier.codec)) for k, c in zip(wire_keys, chunks)]:
            raise RuntimeError(f"{tier.name}: a value did not round-trip")
        for key in keys + wire_keys:
            tier.delete(key)
    return out


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
    tiers: dict[str, BytesBackend] = {}
    try:
        tiers = {
            "kvtier": create_backend(TierSpec.from_url(server.url)),
            "redis": create_backend(TierSpec.from_url(redis.url)),
        }
        raw: dict[str, dict[str, list[float]]] = {
            n: {m: [] for m in ("put", "get", "put_wire", "get_wire", "put_wire_cpu", "get_wire_cpu",
                                "exists", "prefix")} for n in tiers}
        pids = {"kvtier": server.proc.pid, "redis": redis.proc.pid}
        for tier in tiers.values():  # warm up: connections, allocator, page cache
            throughput(tier, pids[tier.name], chunks, 1)
        # Interleave the two tiers block by block, alternating which goes first, so machine
        # noise (these machines are shared) hits both alike.
        for b in range(blocks):
            for name in (list(tiers) if b % 2 == 0 else list(tiers)[::-1]):
                tier = tiers[name]
                for metric, samples in throughput(tier, pids[name], chunks, rounds).items():
                    raw[name][metric] += samples
                present = _keys(8, 999)
                tier.batched_put([(k, chunks[0][:1, :, :16].contiguous()) for k in present])
                probe = present + _keys(8, 998)  # 8 present, then 8 absent
                raw[name]["exists"] += latencies(partial(tier.contains, present[0]), calls)
                raw[name]["prefix"] += latencies(partial(tier.prefix_hits, probe), calls)
                assert leading_run(tier.batched_contains(probe)) == 8
                tier.clear()
    finally:
        for tier in tiers.values():
            tier.close()
        server.stop()
        redis.stop()

    rows = []
    labels = {"put": "PUT chunk, tier API (serde included)", "get": "GET chunk, tier API (serde included)",
              "put_wire": "PUT chunk, bytes on the wire", "get_wire": "GET chunk, bytes on the wire"}
    for metric, label in labels.items():
        a, b = statistics.median(raw["kvtier"][metric]), statistics.median(raw["redis"][metric])
        rows.append({"metric": label, "unit": "GB/s", "kvtier": a, "redis": b, "ratio": a / b,
                     "samples": len(raw["kvtier"][metric])})
    for metric, label in (("put_wire_cpu", "PUT, server CPU per GB"), ("get_wire_cpu", "GET, server CPU per GB")):
        a, b = statistics.mean(raw["kvtier"][metric]), statistics.mean(raw["redis"][metric])
        rows.append({"metric": label, "unit": "s/GB", "kvtier": a, "redis": b, "ratio": b / a if a else float("inf"),
                     "samples": len(raw["kvtier"][metric])})
    for metric, label in (("exists", "EXISTS (1 key)"), ("prefix", "PREFIX_HITS (16 keys)")):
        for q in (0.5, 0.99):
            a, b = _pct(raw["kvtier"][metric], q), _pct(raw["redis"][metric], q)
            rows.append({"metric": f"{label} p{int(q * 100)}", "unit": "µs", "kvtier": a, "redis": b,
                         "ratio": b / a, "samples": len(raw["kvtier"][metric])})

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
    name = "server_quick" if args.quick else "server"  # a quick check never overwrites real figures
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(
        f"# bench_server{' (quick)' if args.quick else ''}\n\n"
        f"{num_chunks} chunks of {chunk_mb:.2f} MB per batch (real KV of the default model, raw codec), "
        f"loopback, one client thread.\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
