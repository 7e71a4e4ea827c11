"""Hit rates on production traces: Mooncake's FAST'25 request traces replayed through kvtier's own
tier code, against the offline optimum and the unlimited bound (`make bench-trace`).

Each request carries one hash id per 512-token block of its prompt (benchmarks/traces/mooncake,
SOURCE.md); a request's reusable prefix is the run of its blocks, from the first, that the cache
holds when it arrives, as kvtier's connector looks a prompt up. The replay asks the tier for that
run (existence, one batched query), reads it (a hit touches its blocks), then stores the blocks
the tier lacked, as the connector stores a prompt's chunks after its prefill. Payloads are tiny
(the budget is counted in blocks of equal size), so what is measured is the policy, through the
real code: the cpu tier (`CPUBackend`: its ByteBudget and eviction policy), the cache server's
store (`ByteStore`), and, on one trace at one capacity (a file per block), the disk tier
(`DiskBackend`).

References, computed here on the same block stream:
- unlimited: every block ever stored stays (the most any cache can hit);
- offline optimum: Belady's rule at block granularity (evict, or do not admit, the block whose
  next use is farthest away), the usual upper reference for a replacement policy.

kvtier's own generated workload (multi-round QA on shared documents, benchmarks/sim/trace.py) is
replayed the same way, as the trace `generated`. The token hit rate is the hit tokens over all
prompt tokens. Capacities are shares of the
trace's distinct blocks. Writes benchmarks/results/trace_replay.{json,md} and
docs/trace_hit_rates.png.

    .venv/bin/python -m benchmarks.bench_trace [--traces conversation,synthetic,generated] [--quick]
"""

from __future__ import annotations

import argparse
import gzip
import heapq
import json
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.backend import StorageBackend, leading_run
from kvstore.backends.disk import DiskBackend
from kvstore.backends.memory import CPUBackend
from kvstore.cache_server.store import ByteStore

ROOT = Path(__file__).resolve().parents[1]
TRACES = Path(__file__).resolve().parent / "traces" / "mooncake"
BLOCK_TOKENS = 512  # one hash id per 512 prompt tokens (SOURCE.md)
SHARES = (0.01, 0.02, 0.05, 0.10, 0.20, 0.50)
DISK_RUN = ("generated", 0.20)  # a file per block: the disk tier replays one trace at one capacity
PAYLOAD = torch.zeros(1, 2, 1, 1, 8, dtype=torch.float16)  # 32 bytes: every block the same size


@dataclass(frozen=True)
class Request:
    """One request of a trace: its prompt length and one block id per 512 tokens of it."""

    input_length: int
    blocks: tuple[int, ...]

    def block_tokens(self, i: int) -> int:
        """Returns the prompt tokens block `i` covers (the last block may be short)."""
        return max(0, min(BLOCK_TOKENS, self.input_length - i * BLOCK_TOKENS))


GENERATED = "generated"
"""kvtier's own multi-round QA workload (benchmarks/sim/trace.py), named like a trace."""


def load_trace(name: str) -> list[Request]:
    """Returns the requests of trace `name` (benchmarks/traces/mooncake/<name>_trace.jsonl.gz, or
    `GENERATED`), in arrival order."""
    if name == GENERATED:
        return generated_trace()
    path = TRACES / f"{name}_trace.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows.sort(key=lambda r: r["timestamp"])  # arrival order (a stable sort keeps each timestamp's order)
    return [Request(int(r["input_length"]), tuple(int(h) for h in r["hash_ids"])) for r in rows]


def generated_trace() -> list[Request]:
    """Returns kvtier's own workload as a trace: 2,000 users over 4 rounds on 64 Zipf-popular 4k
    documents (benchmarks/sim/trace.py), one id per 512-token block of each prompt's prefix."""
    from benchmarks.sim.trace import Workload, make_trace

    ids: dict[tuple[str, int, int], int] = {}
    out = []
    for q in make_trace(Workload(users=2000, rounds=4, docs=64, rate=4.0)):
        blocks = tuple(ids.setdefault(k, len(ids)) for k in q.block_keys(BLOCK_TOKENS))
        out.append(Request(q.prompt_tokens, blocks))
    return out


@dataclass
class Tally:
    """Hit and prompt tokens of one replay."""

    hit_tokens: int = 0
    prompt_tokens: int = 0

    def add(self, request: Request, run: int) -> None:
        self.hit_tokens += sum(request.block_tokens(i) for i in range(run))
        self.prompt_tokens += request.input_length

    @property
    def rate(self) -> float:
        return self.hit_tokens / max(self.prompt_tokens, 1)


# ---- replays through the real code ---------------------------------------------------------------
def _key(block: int) -> str:
    return f"kvtier:trace:float16:v1:c{BLOCK_TOKENS}:{block:032x}"


def replay_tier(requests: Sequence[Request], tier: StorageBackend) -> Tally:
    """Replays `requests` through a tier: lookup (batched_contains), read the held run
    (batched_get: a hit is a use), store what it lacked (batched_put)."""
    tally = Tally()
    for r in requests:
        keys = [_key(b) for b in r.blocks]
        held = tier.batched_contains(keys)
        run = leading_run(held)
        if run:
            tier.batched_get(keys[:run], read_only=True)
        tally.add(r, run)
        missing = [(k, PAYLOAD) for k, h in zip(keys, held) if not h]
        if missing:
            tier.batched_put(missing)
    return tally


def replay_server(requests: Sequence[Request], store: ByteStore) -> Tally:
    """Replays `requests` through the cache server's store, as its handlers call it: EXISTS per
    key, GET of the held run, PUT of what it lacked."""
    tally = Tally()
    value = bytes(PAYLOAD.numel() * PAYLOAD.element_size())
    for r in requests:
        keys = [_key(b).encode() for b in r.blocks]
        held = [store.contains(k) for k in keys]
        run = leading_run(held)
        for k in keys[:run]:
            store.get(k)
        tally.add(r, run)
        for k, h in zip(keys, held):
            if not h:
                store.put(k, value)
    return tally


# ---- references on the block stream ----------------------------------------------------------------
def replay_unlimited(requests: Sequence[Request]) -> Tally:
    """Every block stored stays: the most any cache hits."""
    seen: set[int] = set()
    tally = Tally()
    for r in requests:
        tally.add(r, leading_run([b in seen for b in r.blocks]))
        seen.update(r.blocks)
    return tally


def next_uses(requests: Sequence[Request]) -> list[list[int]]:
    """Returns per request, per block, the index of the next request using that block (len: never)."""
    out: list[list[int]] = [[] for _ in requests]
    later: dict[int, int] = {}
    never = len(requests)
    for i in range(len(requests) - 1, -1, -1):
        out[i] = [later.get(b, never) for b in requests[i].blocks]
        for b in requests[i].blocks:
            later[b] = i
    return out


def replay_optimum(requests: Sequence[Request], capacity: int, nexts: list[list[int]]) -> Tally:
    """Belady's rule over `capacity` blocks: after each request every block it used is due next
    at its next use; the cache keeps the `capacity` blocks due soonest (a block used never again
    is not kept, and a new block due later than all kept ones is not admitted)."""
    due: dict[int, int] = {}  # cached block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block), stale entries skipped
    tally = Tally()
    for i, r in enumerate(requests):
        tally.add(r, leading_run([b in due for b in r.blocks]))
        for b, nxt in zip(r.blocks, nexts[i]):
            if nxt >= len(requests):
                due.pop(b, None)  # never used again: worth nothing
                continue
            due[b] = nxt
            heapq.heappush(heap, (-nxt, b))
        while len(due) > capacity:
            neg, b = heapq.heappop(heap)
            if due.get(b) == -neg:
                del due[b]
    return tally


# ---- the run --------------------------------------------------------------------------------------
def run_trace(name: str, requests: list[Request], quick: bool) -> dict:
    """Returns one trace's figures: per capacity share, each replay's token hit rate."""
    distinct = len({b for r in requests for b in r.blocks})
    nexts = next_uses(requests)
    unlimited = replay_unlimited(requests).rate
    rows = []
    for share in SHARES[1::2] if quick else SHARES:
        blocks = max(1, int(distinct * share))
        row: dict[str, float | int] = {"share": share, "blocks": blocks}
        for label, replay in _replays(requests, blocks, nexts).items():
            t0 = time.perf_counter()
            row[label] = round(replay().rate, 4)
            row[f"{label} s"] = round(time.perf_counter() - t0, 2)
        if (name, share) == DISK_RUN and not quick:
            with tempfile.TemporaryDirectory() as tmp:
                file_bytes = _disk_file_bytes(Path(tmp) / "probe")
                disk = DiskBackend(Path(tmp) / "tier", byte_budget=blocks * file_bytes)
                t0 = time.perf_counter()
                row["disk lru"] = round(replay_tier(requests, disk).rate, 4)
                row["disk lru s"] = round(time.perf_counter() - t0, 2)
                disk.close()
        rows.append(row)
        print(f"{name} {share:.0%}: " + ", ".join(f"{k} {v}" for k, v in row.items() if not k.endswith(" s")),
              flush=True)
    return {"requests": len(requests), "distinct_blocks": distinct,
            "prompt_tokens": sum(r.input_length for r in requests), "unlimited": round(unlimited, 4), "rows": rows}


def _replays(requests: list[Request], blocks: int, nexts: list[list[int]]) -> dict[str, Callable[[], Tally]]:
    """Returns each replay of `requests` over `blocks` blocks of capacity, by its label."""
    item = PAYLOAD.numel() * PAYLOAD.element_size()
    return {
        "optimum": lambda: replay_optimum(requests, blocks, nexts),
        "cpu lru": lambda: replay_tier(requests, CPUBackend(byte_budget=blocks * item, eviction="lru")),
        "cpu fifo": lambda: replay_tier(requests, CPUBackend(byte_budget=blocks * item, eviction="fifo")),
        "cache server lru": lambda: replay_server(requests, ByteStore(blocks * (len(_key(0)) + item), pin_budget=0)),
    }


def _disk_file_bytes(probe: Path) -> int:
    """Returns the bytes one block's file takes in the disk tier (header and payload)."""
    tier = DiskBackend(probe)
    tier.batched_put([(_key(0), PAYLOAD)])
    size = sum(p.stat().st_size for p in probe.rglob("*") if p.is_file() and not p.name.startswith("."))
    tier.close()
    return size


def render(results: dict) -> str:
    lines = ["# Hit rates on production traces", "",
             "Mooncake's FAST'25 traces (benchmarks/traces/mooncake/SOURCE.md) replayed through kvtier's tier code "
             "(`make bench-trace`, benchmarks/bench_trace.py): token hit rate per capacity (a share of the trace's "
             "distinct 512-token blocks), against Belady's offline optimum and the unlimited bound. One run: "
             f"{results['date']}.", ""]
    for name, t in results["traces"].items():
        lines += [f"## {name}: {t['requests']} requests, {t['distinct_blocks']} distinct blocks, "
                  f"unlimited {t['unlimited']:.3f}", ""]
        labels = [k for k in t["rows"][0] if k not in ("share", "blocks") and not k.endswith(" s")]
        if any("disk lru" in r for r in t["rows"]):
            labels.append("disk lru")
        lines += ["| capacity | " + " | ".join(labels) + " | cpu lru / optimum |",
                  "|---:|" + "---:|" * (len(labels) + 1)]
        for r in t["rows"]:
            cells = [f"{r[k]:.3f}" if k in r else "-" for k in labels]
            ratio = r["cpu lru"] / r["optimum"] if r["optimum"] else 0.0
            lines.append(f"| {r['share']:.0%} | " + " | ".join(cells) + f" | {ratio:.2f} |")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = results["traces"]
    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4), squeeze=False)
    for ax, (name, t) in zip(axes[0], traces.items()):
        shares = [r["share"] * 100 for r in t["rows"]]
        for label, style in (("optimum", "k-"), ("cpu lru", "o-"), ("cpu fifo", "s--"), ("cache server lru", "x:")):
            ax.plot(shares, [r[label] for r in t["rows"]], style, label=label)
        ax.axhline(t["unlimited"], color="grey", linestyle="--", label="unlimited")
        ax.set_xscale("log")
        ax.set_xlabel("capacity, % of distinct blocks")
        ax.set_ylabel("token hit rate")
        ax.set_title(name)
        ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default=f"conversation,synthetic,{GENERATED}")
    ap.add_argument("--quick", action="store_true", help="every other capacity, no disk tier")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "trace_replay"))
    args = ap.parse_args(None if argv is None else list(argv))
    results = {"date": time.strftime("%Y-%m-%d"), "quick": args.quick, "traces": {}}
    for name in args.traces.split(","):
        results["traces"][name] = run_trace(name, load_trace(name), args.quick)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    md = render(results)
    out.with_suffix(".md").write_text(md)
    plot(results, ROOT / "docs" / "trace_hit_rates.png")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
