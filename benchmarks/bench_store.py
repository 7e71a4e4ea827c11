"""kvstore tiers and codecs: put/get GB/s on real KV chunks of the default model, with baselines.

In one run: real 256-token KV chunks of SmolLM2-135M (computed by transformers, stacked to
`(layers, 2, 256, kv_heads, head_size)`, fp32 and fp16), stored and loaded through every
tier (device, cpu, disk in a temp dir, redis on a private redis-server) and codec (raw, lz4,
int8). Baselines measured in the same run on the same bytes: a numpy copy (allocating, as a
get must) and plain redis-py pipelined SET/GET with the pure-Python RESP2 parser and with
hiredis. Throughput counts logical (uncompressed) chunk bytes. Figures that matter are
ratios within this run:

- cpu tier get / numpy copy            (target >= 0.5)
- redis tier put / best plain SET, redis tier get / best plain GET   (target >= 0.8 each)
- fp16 size / int8 size                (target >= 1.9); lz4 ratios reported per dtype
- K/V integrity (a keyed MAC on every value): a 4k-token load (16 fp16 chunks) from the disk
  and redis tiers with and without `integrity_key`, interleaved in one run, as a time ratio;
  and keyed BLAKE3 / BLAKE2b / HMAC-SHA256 GB/s on the same bytes (why BLAKE3)

    .venv/bin/python -m benchmarks.bench_store [--quick] [--model DIR] [--only-integrity]

`--only-integrity` measures just the integrity section and merges it into the existing results.

Writes benchmarks/results/store.json and store.md and prints the table.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from harness.redis import start_redis
from kvkeys.keyspace import Keyspace
from kvstore import serde
from kvstore.registry import create_backend
from kvstore.store_config import TierSpec

REPO = Path(__file__).resolve().parents[1]

RESULTS = REPO / "benchmarks" / "results"
CHUNK = 256
TEXT = (
    "The history of caching in computer systems goes back to the earliest machines, where a small "
    "amount of fast memory sat between the processor and a much larger, slower store. "
)


def default_model_dir(cli_path: str | None) -> Path:
    """Returns the model dir: --model, else engine.default_model's converted checkpoint."""
    if cli_path:
        return Path(cli_path)
    try:
        from engine.default_model import ensure_default_model
    except ImportError:
        return Path("/tmp/smol/hf")
    return ensure_default_model()


def real_kv_chunk(model_dir: Path) -> torch.Tensor:
    """Returns one fp32 chunk `(layers, 2, 256, kv_heads, head_size)` from running the model
    over a 256-token text (transformers is the reference implementation here)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(TEXT * 20, return_tensors="pt").input_ids[:, :CHUNK]
    assert ids.shape[1] == CHUNK, "text too short for one chunk"
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    layers = [(layer.keys, layer.values) for layer in cache.layers] if hasattr(cache, "layers") else list(cache)
    # per layer (1, kv_heads, tokens, head_size) -> (layers, 2, tokens, kv_heads, head_size)
    return torch.stack([torch.stack([k[0], v[0]]) for k, v in layers]).transpose(2, 3).contiguous()


def timed(fn: Callable[[], object], reps: int, before: Callable[[], object] | None = None) -> float:
    """Returns the best (minimum) seconds of `reps` calls after one warm-up call (`before` runs,
    untimed, ahead of each): on a shared, noisy machine the minimum is the most repeatable
    estimate of what the code costs."""
    return timed_together([fn], reps, before)[0]


def timed_together(fns: list[Callable[[], object]], reps: int,
                   before: Callable[[], object] | None = None) -> list[float]:
    """Returns each of `fns`' best seconds as `timed` does, the calls interleaved (every fn
    once per round, `reps` rounds after a warm-up round): a burst of noise falls on all of
    them, so their ratio holds better than when each is timed in a block of its own."""
    best = [float("inf")] * len(fns)
    for i in range(reps + 1):
        for j, fn in enumerate(fns):
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            if i:
                best[j] = min(best[j], time.perf_counter() - t0)
    return best


def bench_numpy_copy(chunks: list[torch.Tensor], reps: int) -> float:
    arrays = [c.view(torch.uint8).numpy() if c.dtype != torch.uint8 else c.numpy() for c in chunks]
    nbytes = sum(a.nbytes for a in arrays)
    return nbytes / timed(lambda: [a.copy() for a in arrays], reps) / 1e9


def bench_plain_redis(port: int, chunks: list[torch.Tensor], reps: int) -> dict[str, dict[str, float]]:
    """Returns GB/s of pipelined SET/GET of the chunks' raw bytes with redis-py as it runs
    without hiredis (pure-Python RESP2 parser and command packer) and with hiredis (its parser
    and packer, redis-py's default when hiredis is installed)."""
    import redis
    from redis._parsers import _HiredisParser, _RESP2Parser
    from redis._parsers.encoders import Encoder
    from redis.connection import HiredisRespSerializer, PythonRespSerializer

    values = [bytes(c.contiguous().view(torch.uint8).reshape(-1).numpy()) for c in chunks]
    nbytes = sum(len(v) for v in values)
    keys = [f"plain:{i}" for i in range(len(values))]
    out = {}
    python_packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    for name, parser, packer in (("python", _RESP2Parser, python_packer),
                                 ("hiredis", _HiredisParser, HiredisRespSerializer())):
        pool = redis.ConnectionPool(host="127.0.0.1", port=port, parser_class=parser, protocol=2,
                                    command_packer=packer)
        client = redis.Redis(connection_pool=pool)

        def put(client: redis.Redis = client) -> None:
            pipe = client.pipeline(transaction=False)
            for k, v in zip(keys, values):
                pipe.set(k, v)
            pipe.execute()

        def get(client: redis.Redis = client) -> None:
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            got = pipe.execute()
            assert all(g is not None for g in got)

        out[name] = {"put_gbps": nbytes / timed(put, reps) / 1e9, "get_gbps": nbytes / timed(get, reps) / 1e9}
        client.delete(*keys)
        pool.disconnect()
    return out


def bench_tier(url: str, codec: str, chunks: list[torch.Tensor], reps: int) -> dict[str, float]:
    """Returns put/get GB/s (logical bytes) and the stored-size ratio for one tier and codec."""
    tier = create_backend(TierSpec(url, codec=codec))
    keyspace = Keyspace("bench", chunks[0].dtype, CHUNK, num_layers=1)
    keys = [sp.key for sp in keyspace.spans(np.arange(len(chunks) * CHUNK) + hash(url) % 1000)]
    items = list(zip(keys, chunks))
    nbytes = sum(c.numel() * c.element_size() for c in chunks)
    put_s = timed(lambda: tier.batched_put(items), reps)

    def get() -> None:
        got = tier.batched_get(keys)
        assert all(g is not None for g in got), f"{url} {codec}: miss in benchmark"

    get_s = timed(get, reps)
    stored = sum(len(serde.encode(k, c, codec)) for k, c in items)
    got = tier.batched_get(keys)
    err = max(float((g.float().cpu() - c.float()).abs().max()) for g, c in zip(got, chunks))
    rel = max(float((g.float().cpu() - c.float()).norm() / c.float().norm()) for g, c in zip(got, chunks))
    tier.clear()
    tier.close()
    return {"put_gbps": nbytes / put_s / 1e9, "get_gbps": nbytes / get_s / 1e9,
            "size_ratio": nbytes / stored, "max_abs_err": err, "rel_err": rel}


INTEGRITY_SECRET = "bench secret, 32 bytes long ...."


def bench_mac_algorithms(chunks: list[torch.Tensor], reps: int) -> dict[str, float]:
    """Returns GB/s of each keyed MAC candidate over the chunks' bytes (one thread each)."""
    import hashlib
    import hmac

    import blake3

    views = [memoryview(c.view(torch.uint8).reshape(-1).numpy()) for c in chunks]
    nbytes = sum(v.nbytes for v in views)
    key = b"k" * 32

    def run(make: Callable[[], object]) -> float:
        def once() -> None:
            for v in views:
                h = make()
                h.update(v)  # type: ignore[attr-defined]
                h.digest()  # type: ignore[attr-defined]
        return nbytes / timed(once, reps) / 1e9

    return {"blake3_keyed": run(lambda: blake3.blake3(key=key)),
            "blake2b_keyed": run(lambda: hashlib.blake2b(key=key, digest_size=32)),
            "hmac_sha256": run(lambda: hmac.new(key, digestmod="sha256"))}


def bench_integrity(base: torch.Tensor, urls: dict[str, str], reps: int) -> dict:
    """Returns, per byte tier, the best put/get seconds of a 4k-token load (16 fp16 chunks) with
    and without an integrity key, interleaved rep by rep, and their ratios."""
    chunks = [(base * (1 + 1e-3 * i)).to(torch.float16).contiguous() for i in range(4096 // CHUNK)]
    keys = [sp.key for sp in Keyspace("bench-mac", torch.float16, CHUNK, num_layers=1).spans(np.arange(4096) + 7)]
    items = list(zip(keys, chunks))
    out: dict = {"tokens": 4096, "chunks": len(chunks), "mb": sum(c.numel() * 2 for c in chunks) / 1e6,
                 "mac_gbps": bench_mac_algorithms(chunks, reps), "decode_ms": {}, "tiers": {}}
    # the decode alone (checksum, and MAC when keyed) of the load's values: no I/O noise
    for mode in ("plain", "mac"):
        serde.set_integrity_key(INTEGRITY_SECRET if mode == "mac" else None)
        values = [bytearray(serde.encode(k, c)) for k, c in items]
        out["decode_ms"][mode] = 1e3 * timed(
            lambda values=values: [serde.decode(k, v) for k, v in zip(keys, values)], 2 * reps
        )
    serde.set_integrity_key(None)
    for name, url in urls.items():
        tier = create_backend(TierSpec(url))
        best = {m: {"put_s": float("inf"), "get_s": float("inf")} for m in ("plain", "mac")}
        try:
            for _ in range(2 * reps + 1):  # ratios of two timings: more samples than the other rows
                for mode in ("plain", "mac"):
                    serde.set_integrity_key(INTEGRITY_SECRET if mode == "mac" else None)
                    t0 = time.perf_counter()
                    tier.batched_put(items)
                    best[mode]["put_s"] = min(best[mode]["put_s"], time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    got = tier.batched_get(keys)
                    best[mode]["get_s"] = min(best[mode]["get_s"], time.perf_counter() - t0)
                    assert all(g is not None for g in got), f"{name}: miss in the integrity benchmark"
        finally:
            serde.set_integrity_key(None)
            tier.clear()
            tier.close()
        out["tiers"][name] = {**best, "get_ratio": best["mac"]["get_s"] / best["plain"]["get_s"],
                              "put_ratio": best["mac"]["put_s"] / best["plain"]["put_s"]}
        print(f"  integrity {name:6s} load x{out['tiers'][name]['get_ratio']:.2f}  "
              f"store x{out['tiers'][name]['put_ratio']:.2f}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer chunks and repetitions (validates the script)")
    ap.add_argument("--model", help="HF checkpoint dir (default: the converted default model)")
    ap.add_argument("--out", default=str(RESULTS / "store"), help="output path without extension")
    ap.add_argument("--only-integrity", action="store_true",
                    help="measure only the integrity section and merge it into the existing results")
    args = ap.parse_args()
    n_chunks, reps = (2, 3) if args.quick else (8, 7)

    model_dir = default_model_dir(args.model)
    print(f"computing a real KV chunk with transformers from {model_dir} ...", flush=True)
    base = real_kv_chunk(model_dir)
    server = start_redis()
    tmp = tempfile.TemporaryDirectory(prefix="kvtier-bench-disk-")
    tiers = {"cpu": "cpu", "device": "device", "disk": f"disk://{tmp.name}", "redis": server.url}
    if args.only_integrity:
        try:
            integrity = bench_integrity(base, {"disk": tiers["disk"], "redis": tiers["redis"]}, reps)
        finally:
            server.stop()
            tmp.cleanup()
        return write_results({**json.loads(Path(args.out).with_suffix(".json").read_text()),
                              "integrity": integrity}, Path(args.out))
    results: dict = {"config": {"chunk_tokens": CHUNK, "chunk_shape": list(base.shape), "chunks_per_batch": n_chunks,
                                "reps": reps, "quick": args.quick, "model": str(model_dir),
                                "python": platform.python_version(), "torch": torch.__version__,
                                "cuda": torch.cuda.is_available(), "machine": platform.machine()},
                     "dtypes": {}}
    try:
        for dtype in (torch.float32, torch.float16):
            # distinct chunks per slot (like different prompts): the real chunk, slightly perturbed
            chunks = [(base * (1 + 1e-3 * i)).to(dtype).contiguous() for i in range(n_chunks)]
            name = str(dtype).removeprefix("torch.")
            print(
                f"[{name}] chunk {chunks[0].numel() * chunks[0].element_size() / 1e6:.1f} MB x {n_chunks}", flush=True
            )
            entry: dict = {"chunk_mb": chunks[0].numel() * chunks[0].element_size() / 1e6,
                           "numpy_copy_gbps": bench_numpy_copy(chunks, reps),
                           "plain_redis": bench_plain_redis(server.port, chunks, reps), "tiers": {}}
            for tier_name, url in tiers.items():
                for codec in ("raw", "lz4", "int8"):
                    r = bench_tier(url, codec, chunks, reps)
                    entry["tiers"][f"{tier_name}/{codec}"] = r
                    print(f"  {tier_name:6s} {codec:5s} put {r['put_gbps']:6.2f} GB/s  get {r['get_gbps']:6.2f} GB/s"
                          f"  x{r['size_ratio']:.2f} smaller", flush=True)
            best_put = max(v["put_gbps"] for v in entry["plain_redis"].values())
            best_get = max(v["get_gbps"] for v in entry["plain_redis"].values())
            entry["ratios"] = {
                "cpu_get_vs_numpy_copy": entry["tiers"]["cpu/raw"]["get_gbps"] / entry["numpy_copy_gbps"],
                "redis_put_vs_best_plain": entry["tiers"]["redis/raw"]["put_gbps"] / best_put,
                "redis_get_vs_best_plain": entry["tiers"]["redis/raw"]["get_gbps"] / best_get,
                "lz4_size_ratio": entry["tiers"]["cpu/lz4"]["size_ratio"],
                "int8_size_ratio": entry["tiers"]["cpu/int8"]["size_ratio"],
            }
            results["dtypes"][name] = entry
        fp16 = results["dtypes"]["float16"]
        results["targets"] = {
            "cpu_get_vs_numpy_copy>=0.5": all(
                d["ratios"]["cpu_get_vs_numpy_copy"] >= 0.5 for d in results["dtypes"].values()
            ),
            "redis_put_vs_best_plain>=0.8": all(
                d["ratios"]["redis_put_vs_best_plain"] >= 0.8 for d in results["dtypes"].values()
            ),
            "redis_get_vs_best_plain>=0.8": all(
                d["ratios"]["redis_get_vs_best_plain"] >= 0.8 for d in results["dtypes"].values()
            ),
            "int8_vs_fp16_size>=1.9": fp16["ratios"]["int8_size_ratio"] >= 1.9,
        }
        results["integrity"] = bench_integrity(base, {"disk": tiers["disk"], "redis": tiers["redis"]}, reps)
    finally:
        server.stop()
        tmp.cleanup()
    return write_results(results, Path(args.out))


def write_results(results: dict, out: Path) -> int:
    """Writes `out`.json and `out`.md and prints the table; returns the exit status."""
    md = render_markdown(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


def render_markdown(results: dict) -> str:
    cfg = results["config"]
    lines = [
        f"# kvstore: tiers and codecs ({'quick' if cfg['quick'] else 'full'} run)",
        "",
        f"Real KV chunks of the default model, {cfg['chunk_tokens']} tokens, shape {tuple(cfg['chunk_shape'])}, "
        f"{cfg['chunks_per_batch']} chunks per batched call, best of {cfg['reps']}. GB/s of logical chunk bytes.",
        "",
    ]
    for name, d in results["dtypes"].items():
        lines += [f"## {name} ({d['chunk_mb']:.1f} MB per chunk)", "",
                  "| tier/codec | put GB/s | get GB/s | size ratio | max abs err | rel err |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines.append(f"| numpy copy (baseline) | | {d['numpy_copy_gbps']:.2f} | | | |")
        for parser, r in d["plain_redis"].items():
            lines.append(
                f"| plain redis-py, {'no hiredis' if parser == 'python' else 'hiredis'} (baseline) "
                f"| {r['put_gbps']:.2f} | {r['get_gbps']:.2f} | | | |"
            )
        for tc, r in d["tiers"].items():
            lines.append(f"| {tc} | {r['put_gbps']:.2f} | {r['get_gbps']:.2f} | {r['size_ratio']:.2f}x "
                         f"| {r['max_abs_err']:.3g} | {r['rel_err']:.3g} |")
        ratios = d["ratios"]
        lines += [
            "",
            f"- cpu get / numpy copy: **{ratios['cpu_get_vs_numpy_copy']:.2f}x** (target >= 0.5)",
            f"- redis put / best plain redis-py SET: **{ratios['redis_put_vs_best_plain']:.2f}x** (target >= 0.8)",
            f"- redis get / best plain redis-py GET: **{ratios['redis_get_vs_best_plain']:.2f}x** (target >= 0.8)",
            f"- lz4 (byte-shuffled) size ratio: **{ratios['lz4_size_ratio']:.2f}x**; "
            f"int8: **{ratios['int8_size_ratio']:.2f}x** smaller than {name}",
            "",
        ]
    lines += ["Targets met: " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in results["targets"].items()), ""]
    if "integrity" in results:
        lines += render_integrity(results["integrity"])
    return "\n".join(lines)


def render_integrity(r: dict) -> list[str]:
    mac = r["mac_gbps"]
    lines = [
        f"## K/V integrity: a {r['tokens']}-token load ({r['chunks']} fp16 chunks, {r['mb']:.0f} MB) "
        "with and without `integrity_key`",
        "",
        "| tier | load ms (no MAC) | load ms (MAC) | load ratio | store ms (no MAC) | store ms (MAC) | store ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, t in r["tiers"].items():
        lines.append(f"| {name}/raw | {t['plain']['get_s'] * 1e3:.1f} | {t['mac']['get_s'] * 1e3:.1f} | "
                     f"{t['get_ratio']:.2f}x | {t['plain']['put_s'] * 1e3:.1f} | {t['mac']['put_s'] * 1e3:.1f} | "
                     f"{t['put_ratio']:.2f}x |")
    dec = r.get("decode_ms")
    if dec:
        lines += ["", f"Decoding the load's 16 values alone (no I/O): {dec['plain']:.1f} ms with the checksum only, "
                  f"{dec['mac']:.1f} ms with checksum and MAC (**+{dec['mac'] - dec['plain']:.1f} ms** per 4k tokens)."]
    lines += ["", "Keyed MAC candidates on the same bytes, one thread: "
              f"BLAKE3 **{mac['blake3_keyed']:.2f} GB/s**, keyed BLAKE2b {mac['blake2b_keyed']:.2f} GB/s, "
              f"HMAC-SHA256 {mac['hmac_sha256']:.2f} GB/s (BLAKE3 is used).", ""]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
