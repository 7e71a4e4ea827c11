"""Why the disk tier reads into recycled, page-aligned buffers (kvstore/read_buffers.py).

In one run, on the same files: a 4k-token load's worth of 256-token fp32 chunks of the default
model's shape (16 x ~12 MB) written by the disk tier, then fetched the way the connector's
loader does (connector/loader.py): two chunks per fetch on a prefetch thread, the next fetch
under way while this thread holds the current pair. Arm "fresh": the tier's pool keeps no free
buffer (`max_free_bytes=0`: every read allocates, as before the pool); arm "recycled": the
default pool; arm "unaligned": the default pool with every view 16 bytes past a page boundary
(where a bytearray's data starts, as before views were aligned). Interleaved; the figures are
time ratios within this run.

    .venv/bin/python -m benchmarks.bench_read_buffers [--reps N]

Writes benchmarks/results/read_buffers.json and read_buffers.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvstore.read_buffers import ReadBufferPool
from kvstore.registry import create_backend
from kvstore.store_config import TierSpec

REPO = Path(__file__).resolve().parents[1]

CHUNK_SHAPE = (30, 2, 256, 3, 64)  # SmolLM2-135M: 30 layers, 3 KV heads, head size 64
CHUNKS = 16
GROUP = 2


class UnalignedPool(ReadBufferPool):
    """The default pool, every view 16 bytes past a page boundary."""

    def take(self, nbytes: int) -> memoryview:
        return super().take(nbytes + 16)[16:]


def load(tier: object, keys: list[str], prefetch: ThreadPoolExecutor) -> float:
    """Returns the seconds to fetch every key, GROUP per fetch, one fetch ahead."""
    t0 = time.perf_counter()
    groups = [keys[i:i + GROUP] for i in range(0, len(keys), GROUP)]
    pending = prefetch.submit(tier.batched_get, groups[0])  # type: ignore[attr-defined]
    for g in range(len(groups)):
        got = pending.result()
        if g + 1 < len(groups):
            pending = prefetch.submit(tier.batched_get, groups[g + 1])  # type: ignore[attr-defined]
        assert all(v is not None for v in got)
        del got  # scattered: dropped
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    times: dict[str, list[float]] = {"fresh": [], "recycled": [], "unaligned": []}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-read-") as tmp, ThreadPoolExecutor(1) as prefetch:
        tier = create_backend(TierSpec(f"disk://{tmp}/d"))
        keys = [f"kvtier:bench:float32:v1:c256:{i:032x}" for i in range(CHUNKS)]
        for k in keys:
            tier.put(k, torch.randn(CHUNK_SHAPE))
        nbytes = sum(p.stat().st_size for p in Path(tmp, "d").glob("*.kvc"))
        pools = {"fresh": ReadBufferPool(max_free_bytes=0), "recycled": ReadBufferPool(), "unaligned": UnalignedPool()}
        for _ in range(args.reps):  # interleaved, so drift hits both alike
            for arm, pool in pools.items():
                tier._read_buffers = pool  # type: ignore[attr-defined]
                times[arm].append(load(tier, keys, prefetch))
    res = {"platform": platform.platform(), "reps": args.reps, "chunks": CHUNKS, "bytes": nbytes,
           **{f"{arm}_s": statistics.median(t) for arm, t in times.items()}}
    res["recycled_over_fresh"] = res["recycled_s"] / res["fresh_s"]
    res["recycled_over_unaligned"] = res["recycled_s"] / res["unaligned_s"]
    out = REPO / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "read_buffers.json").write_text(json.dumps(res, indent=2) + "\n")
    gb = nbytes / 1e9
    table = "\n".join([
        "| disk tier fetch of a 4k-token load (loader's pattern) | time | GB/s |", "|---|---:|---:|",
        *(f"| {arm} buffers | {res[f'{arm}_s'] * 1e3:.1f} ms | {gb / res[f'{arm}_s']:.1f} |" for arm in times),
        f"| recycled / fresh | {res['recycled_over_fresh']:.2f} | |",
        f"| recycled (page-aligned) / unaligned | {res['recycled_over_unaligned']:.2f} | |",
    ]) + "\n"
    (out / "read_buffers.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
