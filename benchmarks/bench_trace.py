"""Hit rates on production traces: Mooncake's FAST'25 request traces replayed through kvtier's own
tier code, against the offline optimum and the unlimited bound (`make bench-trace`).

Each request carries one hash id per 512-token block of its prompt (benchmarks/traces/mooncake,
SOURCE.md); a request's reusable prefix is the run of its blocks, from the first, that the cache
holds when it arrives, as kvtier's connector looks a prompt up. The replay asks the tier for that
run (existence, one batched query), reads it (a hit touches its blocks), then stores the blocks
the tier lacked, as the connector stores a prompt's chunks after its prefill. Payloads are tiny
(the budget is counted in blocks of equal size), so what is measured is the policy, through the
real code: the cpu tier (`CPUBackend`: its ByteBudget and each eviction policy of
kvstore/eviction.py), the cache server's store (`ByteStore`), and, on one trace at one capacity (a
file per block), the disk tier (`DiskBackend`).

References, computed here on the same block stream:
- unlimited: every block ever stored stays (the most any cache can hit);
- offline optimum: Belady's rule at block granularity (evict, or do not admit, the block whose
  next use is farthest away), the usual upper reference for a replacement policy;
- chain-aware LRU (a block-level simulation: a tier is not told which chunk a chunk extends):
  a request's blocks are touched tail first, so a chain's tail leaves before its head, and a
  block whose parent left is evicted next;
- LRU with a reuse oracle (a simulation): told whether each block will be used again, it stores
  and keeps only those; the most a predictor of reuse could add to LRU.

Each policy's hit rate is also given as a ratio to LRU's at the same capacity; the target for
the default policy is at least 1.10x averaged over 2-20% capacity and never below 0.98x.

Tiers as a hierarchy, on the conversation trace: a cpu tier over a disk tier, the disk written
every chunk (write-through) or only what the cpu tier evicts (`fill=demote`), through the storage
manager (kvstore/trace_replay.py `plan`, the tiers modelled by their budgets and LRU): hit rate
and bytes written per tier.

kvtier's own generated workload (multi-round QA on shared documents, benchmarks/sim/trace.py) is
replayed the same way, as the trace `generated`. The token hit rate is the hit tokens over all
prompt tokens. Capacities are shares of the
trace's distinct blocks. Writes benchmarks/results/trace_replay.{json,md} and
docs/trace_hit_rates.png.

    .venv/bin/python -m benchmarks.bench_trace [--traces conversation,synthetic,generated] [--quick]
"""

from __future__ import annotations

import argparse
import heapq
import json
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path

from kvstore.backend import leading_run
from kvstore.backends.disk import DiskBackend
from kvstore.backends.memory import CPUBackend
from kvstore.cache_server.store import ByteStore
from kvstore.eviction import DEFAULT_POLICY, POLICIES
from kvstore.store_config import FILLS, TierSpec
from kvstore.trace_replay import PAYLOAD, PAYLOAD_BYTES, Tally, plan, replay_tier, trace_key
from kvstore.traces import BLOCK_TOKENS, Request, read_trace

ROOT = Path(__file__).resolve().parents[1]
TRACES = Path(__file__).resolve().parent / "traces" / "mooncake"
SHARES = (0.01, 0.02, 0.05, 0.10, 0.20, 0.50)
DISK_RUN = ("generated", 0.20)  # a file per block: the disk tier replays one trace at one capacity
HIERARCHY = ((0.02, 0.10), (0.05, 0.20))  # (cpu, disk) capacities of the two-tier replays
HIERARCHY_TRACE = "conversation"  # the two-tier replays' trace


GENERATED = "generated"
"""kvtier's own multi-round QA workload (benchmarks/sim/trace.py), named like a trace."""


def load_trace(name: str) -> list[Request]:
    """Returns the requests of trace `name` (benchmarks/traces/mooncake/<name>_trace.jsonl.gz, or
    `GENERATED`), in arrival order."""
    if name == GENERATED:
        return generated_trace()
    return read_trace(TRACES / f"{name}_trace.jsonl.gz")


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


def replay_server(requests: Sequence[Request], store: ByteStore) -> Tally:
    """Replays `requests` through the cache server's store, as its handlers call it: EXISTS per
    key, GET of the held run, PUT of what it lacked."""
    tally = Tally()
    value = bytes(PAYLOAD_BYTES)
    for r in requests:
        keys = [trace_key(b).encode() for b in r.blocks]
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


def replay_chain_lru(requests: Sequence[Request], capacity: int) -> Tally:
    """Chain-aware LRU over `capacity` blocks: each request touches its blocks tail first (its
    head most recent), and a block whose parent is evicted goes first in line (without its
    parent it can never be part of a hit)."""
    order: OrderedDict[int, None] = OrderedDict()
    children: dict[int, set[int]] = {}
    tally = Tally()
    for r in requests:
        tally.add(r, leading_run([b in order for b in r.blocks]))
        for j in range(len(r.blocks) - 1, -1, -1):
            b = r.blocks[j]
            if b in order:
                order.move_to_end(b)
                continue
            order[b] = None
            if j:
                children.setdefault(r.blocks[j - 1], set()).add(b)
        while len(order) > capacity:
            gone, _ = order.popitem(last=False)
            for child in children.pop(gone, ()):
                if child in order:
                    order.move_to_end(child, last=False)
    return tally


def replay_reuse_oracle(requests: Sequence[Request], capacity: int, nexts: list[list[int]]) -> Tally:
    """LRU over `capacity` blocks told one bit per block that no online policy has: whether the
    block will be used again. Blocks that will not are neither stored nor kept; the rest is
    LRU's. What a predictor of reuse could at most add to LRU."""
    order: OrderedDict[int, None] = OrderedDict()
    tally = Tally()
    for i, r in enumerate(requests):
        tally.add(r, leading_run([b in order for b in r.blocks]))
        for b, nxt in zip(r.blocks, nexts[i]):
            if nxt >= len(requests):
                order.pop(b, None)
            elif b in order:
                order.move_to_end(b)
            else:
                order[b] = None
        while len(order) > capacity:
            order.popitem(last=False)
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


def run_hierarchy(requests: list[Request], distinct: int) -> list[dict]:
    """Returns per (cpu, disk) capacity of `HIERARCHY` and per fill of the disk tier (write-
    through, or demotion of what the cpu tier evicts) the token hit rate and the bytes each tier
    was written (a byte per token, so a prompt's short last block counts its tokens), through the
    storage manager over two tiers modelled by their budgets and policies (`kvtier cache plan`'s
    replay)."""
    rows = []
    for cpu_share, disk_share in HIERARCHY:
        row: dict[str, float] = {"cpu share": cpu_share, "disk share": disk_share}
        for fill in FILLS:
            tiers = [TierSpec(url="cpu", budget=int(distinct * cpu_share) * BLOCK_TOKENS),
                     TierSpec(url="disk:///trace", budget=int(distinct * disk_share) * BLOCK_TOKENS, fill=fill)]
            t0 = time.perf_counter()
            seen = plan(requests, tiers, kv_bytes_per_token=1)
            row[f"{fill} hit rate"] = round(seen.hit_rate, 4)
            row[f"{fill} cpu bytes"] = seen.tiers[0].bytes_written
            row[f"{fill} disk bytes"] = seen.tiers[1].bytes_written
            row[f"{fill} s"] = round(time.perf_counter() - t0, 1)
        print(f"hierarchy cpu {cpu_share:.0%} + disk {disk_share:.0%}: "
              + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
        rows.append(row)
    return rows


def _replays(requests: list[Request], blocks: int, nexts: list[list[int]]) -> dict[str, Callable[[], Tally]]:
    """Returns each replay of `requests` over `blocks` blocks of capacity, by its label."""
    item = PAYLOAD_BYTES
    replays: dict[str, Callable[[], Tally]] = {"optimum": lambda: replay_optimum(requests, blocks, nexts)}
    for policy in POLICIES:
        tier = CPUBackend(byte_budget=blocks * item, eviction=policy)
        replays[f"cpu {policy}"] = partial(replay_tier, requests, tier)
    replays["chain lru (sim)"] = lambda: replay_chain_lru(requests, blocks)
    replays["lru + reuse oracle (sim)"] = lambda: replay_reuse_oracle(requests, blocks, nexts)
    for policy in sorted({"lru", DEFAULT_POLICY}):
        store = ByteStore(blocks * (len(trace_key(0)) + item), pin_budget=0, eviction=policy)
        replays[f"cache server {policy}"] = partial(replay_server, requests, store)
    return replays


def _disk_file_bytes(probe: Path) -> int:
    """Returns the bytes one block's file takes in the disk tier (header and payload)."""
    tier = DiskBackend(probe)
    tier.batched_put([(trace_key(0), PAYLOAD)])
    size = sum(p.stat().st_size for p in probe.rglob("*") if p.is_file() and not p.name.startswith("."))
    tier.close()
    return size


TARGET_SHARES = (0.02, 0.05, 0.10, 0.20)  # where the default policy's target is set


def against_lru(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Returns per policy (each "cpu ..." replay and the chain-aware simulation) its hit rate over
    LRU's at each capacity of `TARGET_SHARES`, their mean ("mean") and their least ("min")."""
    rows = [r for r in rows if r["share"] in TARGET_SHARES]
    out: dict[str, dict[str, float]] = {}
    for label in rows[0] if rows else ():
        if not label.startswith(("cpu ", "chain ", "lru + ")) or label.endswith(" s"):
            continue
        ratios = {f"{r['share']:.0%}": r[label] / r["cpu lru"] if r["cpu lru"] else 0.0 for r in rows}
        out[label] = {**ratios, "mean": sum(ratios.values()) / len(ratios), "min": min(ratios.values())}
    return out


def meets_target(ratios: dict[str, float]) -> bool:
    """Returns whether a policy's ratios to LRU meet the default's target: mean >= 1.10, min >= 0.98."""
    return ratios["mean"] >= 1.10 and ratios["min"] >= 0.98


def render(results: dict) -> str:
    lines = ["# Hit rates on production traces", "",
             "Mooncake's FAST'25 traces (benchmarks/traces/mooncake/SOURCE.md) replayed through kvtier's tier code "
             "(`make bench-trace`, benchmarks/bench_trace.py): token hit rate per capacity (a share of the trace's "
             "distinct 512-token blocks), against Belady's offline optimum and the unlimited bound. `cpu <policy>` is "
             "the cpu tier with that eviction policy (kvstore/eviction.py); `chain lru (sim)` a block-level simulation "
             "of chain-aware LRU; `lru + reuse oracle (sim)` LRU told which blocks will be used again. "
             f"The default policy is `{DEFAULT_POLICY}`. One run: {results['date']}.", ""]
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
        ratios = against_lru(t["rows"])
        if ratios:
            shares = [k for k in next(iter(ratios.values())) if k.endswith("%")]
            lines += ["", "Hit rate over LRU's (target for the default: mean >= 1.10, min >= 0.98):", "",
                      "| policy | " + " | ".join(shares) + " | mean | min | meets target |",
                      "|---|" + "---:|" * (len(shares) + 2) + "---|"]
            for label, rr in ratios.items():
                lines.append(f"| {label} | " + " | ".join(f"{rr[k]:.2f}" for k in shares)
                             + f" | {rr['mean']:.2f} | {rr['min']:.2f} | {'yes' if meets_target(rr) else 'no'} |")
        lines.append("")
    if "hierarchy" in results:
        h = results["hierarchy"]
        lines += [f"## Tiers as a hierarchy: {h['trace']}, a cpu tier over a disk tier", "",
                  "Through a storage manager over the two tiers, each modelled by its budget and LRU (`kvtier cache "
                  "plan`'s replay, kvstore/trace_replay.py): the disk tier written every chunk stored (write-through, "
                  "`fill=write`) or only what the cpu tier evicts (`fill=demote`); a disk hit is promoted to cpu. "
                  "Bytes: one per token of each block written (a prompt's short last block counts its tokens).", "",
                  "| cpu + disk capacity | hit rate, write / demote | demote / write | disk bytes, write / demote "
                  "| write / demote | cpu bytes, write / demote |",
                  "|---|---|---:|---|---:|---|"]
        for r in h["rows"]:
            lines.append(
                f"| {r['cpu share']:.0%} + {r['disk share']:.0%} "
                f"| {r['write hit rate']:.3f} / {r['demote hit rate']:.3f} "
                f"| {r['demote hit rate'] / r['write hit rate']:.3f} "
                f"| {r['write disk bytes']:,} / {r['demote disk bytes']:,} "
                f"| {r['write disk bytes'] / max(r['demote disk bytes'], 1):.2f}x "
                f"| {r['write cpu bytes']:,} / {r['demote cpu bytes']:,} |")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = results["traces"]
    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.5), squeeze=False)
    for ax, (name, t) in zip(axes[0], traces.items()):
        shares = [r["share"] * 100 for r in t["rows"]]
        labels = [k for k in t["rows"][0] if k == "optimum" or k.startswith(("cpu ", "chain ", "lru + "))]
        for label in labels:
            if not label.endswith(" s"):
                ax.plot(shares, [r[label] for r in t["rows"]], "k-" if label == "optimum" else "o-", label=label,
                        markersize=3)
        ax.axhline(t["unlimited"], color="grey", linestyle="--", label="unlimited")
        ax.set_xscale("log")
        ax.set_xlabel("capacity, % of distinct blocks")
        ax.set_ylabel("token hit rate")
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default=f"conversation,synthetic,{GENERATED}")
    ap.add_argument("--quick", action="store_true", help="every other capacity, no disk tier, no two-tier replays")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "trace_replay"))
    args = ap.parse_args(None if argv is None else list(argv))
    results = {"date": time.strftime("%Y-%m-%d"), "quick": args.quick, "traces": {}}
    for name in args.traces.split(","):
        requests = load_trace(name)
        results["traces"][name] = run_trace(name, requests, args.quick)
        if name == HIERARCHY_TRACE and not args.quick:
            rows = run_hierarchy(requests, results["traces"][name]["distinct_blocks"])
            results["hierarchy"] = {"trace": name, "rows": rows}
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
