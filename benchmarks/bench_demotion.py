"""Demotion filters on a production trace: which chunks that a cpu tier evicts are worth writing to
the disk tier below it (`make bench-demotion`).

With `fill=demote` the disk tier is written only what the cpu tier evicts; nearly every chunk
leaves the cpu tier before it is used again, so demotion writes almost as many bytes as
write-through. A filter that writes fewer must tell the chunks that come back from the ones that
do not. This benchmark measures, on Mooncake's conversation trace, each filter's hit rate over
write-through's and how many times fewer bytes it writes to the disk tier (the target: at least
0.98x and 2x), at several (cpu, disk) capacities.

The replay is a block-level model of `kvtier cache plan`'s (kvstore/trace_replay.py): a cpu tier
over a disk tier, both LRU, budgets in tokens (a prompt's short last block takes its own), disk
hits promoted, and each chunk the cpu tier evicts offered to a filter with what was known of it
when it was stored and since: its request's rank of it among the chunks the request stored, its
uses in cpu, whether it was evicted before, and the request's turn in its conversation, time since
the conversation's last turn, prompt length and prefix hit. tests/test_bench_demotion.py checks
the model against `plan`, figure for figure. Figures are on the trace's second half (the first
warms the tiers).

Filters:
- none: plain demotion;
- an oracle: the chunk is used again (the most a filter could know);
- used in cpu;
- the request's: the head 35% of its request's new chunks, or evicted before, or used in cpu;
- learned: a gradient-boosted classifier (scikit-learn) over every feature above, fitted on the
  first half's demotions (labelled: read back from the disk under plain demotion) and deciding
  the second half's, keeping the top share of its scores, a chunk only behind a held parent.
  It is the bound for any filter of these features that learns from this traffic.

    .venv/bin/python -m benchmarks.bench_demotion [--quick]
"""

from __future__ import annotations

import argparse
import bisect
import json
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.bench_trace import load_trace
from kvstore.traces import Request

ROOT = Path(__file__).resolve().parents[1]
PAIRS = ((0.01, 0.05), (0.02, 0.10), (0.02, 0.20), (0.05, 0.20), (0.05, 0.50), (0.10, 0.50))
LEARNED_PAIRS = PAIRS  # where the learned filter is fitted (a minute or two each)
LEARNED_SHARES = (0.5, 0.55)  # shares of the first half's demotions the learned filter keeps
HEAD_SHARE = 0.35


@dataclass(slots=True)
class Chunk:
    """What is known of a chunk held in the cpu tier."""

    request: int  # the request that stored it (or promoted it)
    pos: int  # its block's position in that request's prompt
    rank: int  # its rank among the chunks that request stored (-1: promoted from disk)
    stored: int  # how many chunks that request stored
    tokens: int
    parent: int | None  # the block before it in that prompt
    stored_at: int
    last_use: int
    uses: int = 0


@dataclass
class Outcome:
    """One replay's figures over the measured requests."""

    hit_tokens: int = 0
    prompt_tokens: int = 0
    disk_tokens: int = 0  # tokens written to the disk tier

    @property
    def rate(self) -> float:
        return self.hit_tokens / max(self.prompt_tokens, 1)


@dataclass
class Context:
    """The trace's per-request facts a filter may read (all known when the request arrives)."""

    turn: list[int]  # the request's turn in its conversation (0: its prefix beyond block 0 is new)
    gap: list[int]  # requests since the conversation's last turn (-1: a first turn)
    lead: list[int]  # blocks of its prompt seen before (its prefix hit, with unlimited capacity)
    uses: dict[int, list[int]]  # per block, the requests using it, in order

    @classmethod
    def of(cls, requests: Sequence[Request]) -> Context:
        last: dict[int, int] = {}
        turn_of: dict[int, int] = {}
        turns, gaps, leads = [], [], []
        for t, r in enumerate(requests):
            lead = 0
            while lead < len(r.blocks) and r.blocks[lead] in last:
                lead += 1
            continuing = lead >= 2  # block 0 is every prompt's system prompt
            turns.append(turn_of[r.blocks[lead - 1]] + 1 if continuing else 0)
            gaps.append(t - last[r.blocks[lead - 1]] if continuing else -1)
            leads.append(lead)
            for b in r.blocks:
                last[b] = t
                turn_of[b] = turns[-1]
        uses: dict[int, list[int]] = defaultdict(list)
        for t, r in enumerate(requests):
            for b in r.blocks:
                uses[b].append(t)
        return cls(turns, gaps, leads, dict(uses))


Decide = Callable[[list[tuple[int, Chunk]], "Tiers"], list[bool]]
"""A filter: given the chunks the cpu tier just evicted (block, what is known of it), in eviction
order, and the tiers, returns which to write to the disk tier."""


@dataclass
class Tiers:
    """A cpu tier over a disk tier, both LRU, budgets in tokens."""

    cpu_budget: int
    disk_budget: int
    cpu: OrderedDict[int, Chunk] = field(default_factory=OrderedDict)
    disk: OrderedDict[int, int] = field(default_factory=OrderedDict)  # block -> tokens
    cpu_used: int = 0
    disk_used: int = 0
    evicted: list[tuple[int, Chunk]] = field(default_factory=list)
    now: int = 0

    def put_cpu(self, block: int, chunk: Chunk) -> None:
        if chunk.tokens > self.cpu_budget:
            return
        while self.cpu_used + chunk.tokens > self.cpu_budget:
            old, meta = self.cpu.popitem(last=False)
            self.cpu_used -= meta.tokens
            self.evicted.append((old, meta))
        self.cpu[block] = chunk
        self.cpu_used += chunk.tokens

    def put_disk(self, block: int, tokens: int) -> bool:
        if block in self.disk or tokens > self.disk_budget:
            return False
        while self.disk_used + tokens > self.disk_budget:
            self.disk_used -= self.disk.popitem(last=False)[1]
        self.disk[block] = tokens
        self.disk_used += tokens
        return True


def replay(requests: Sequence[Request], cpu_budget: int, disk_budget: int, fill: str,
           decide: Decide | None = None, start: int = 0,
           on_disk_hit: Callable[[int, int, int], None] | None = None) -> Outcome:
    """Returns the figures of `requests[start:]` replayed through a cpu tier over a disk tier of
    the budgets given (tokens), the disk written every chunk stored (`fill="write"`) or what the
    cpu tier evicts and `decide` keeps (`"demote"`; None: all). `on_disk_hit(block, request,
    tokens)` is told of each block served from the disk tier."""
    tiers = Tiers(cpu_budget, disk_budget)
    out = Outcome()
    for t, r in enumerate(requests):
        tiers.now = t
        keys = r.blocks
        held = [b in tiers.cpu or b in tiers.disk for b in keys]  # one lookup, before anything moves
        run = 0
        while run < len(keys) and held[run]:
            run += 1
        promoted = []
        for i in range(run):
            b = keys[i]
            if b in tiers.cpu:
                tiers.cpu.move_to_end(b)
                meta = tiers.cpu[b]
                meta.uses += 1
                meta.last_use = t
            else:
                tiers.disk.move_to_end(b)
                promoted.append(i)
                if on_disk_hit is not None:
                    on_disk_hit(b, t, r.block_tokens(i))
        if t >= start:
            out.hit_tokens += sum(r.block_tokens(i) for i in range(run))
            out.prompt_tokens += r.input_length
        for i in promoted:
            tiers.put_cpu(keys[i], Chunk(t, i, -1, 0, r.block_tokens(i), keys[i - 1] if i else None, t, t))
        missing = [i for i in range(run, len(keys)) if not held[i]]
        for rank, i in enumerate(missing):
            tiers.put_cpu(keys[i], Chunk(t, i, rank, len(missing), r.block_tokens(i), keys[i - 1] if i else None, t, t))
        if fill == "write":
            for i in missing:
                if tiers.put_disk(keys[i], r.block_tokens(i)) and t >= start:
                    out.disk_tokens += r.block_tokens(i)
        jobs = [(b, c) for b, c in tiers.evicted if b not in tiers.disk]
        tiers.evicted.clear()
        if fill == "demote" and jobs:
            keep = decide(jobs, tiers) if decide is not None else [True] * len(jobs)
            for (b, c), k in zip(jobs, keep):
                if k and tiers.put_disk(b, c.tokens) and t >= start:
                    out.disk_tokens += c.tokens
    return out


def oracle(ctx: Context) -> Decide:
    """Returns the filter told whether each chunk is used again."""
    def decide(jobs: list[tuple[int, Chunk]], tiers: Tiers) -> list[bool]:
        return [bisect.bisect_right(ctx.uses[b], tiers.now) < len(ctx.uses[b]) for b, _ in jobs]
    return decide


def used_in_cpu(jobs: list[tuple[int, Chunk]], tiers: Tiers) -> list[bool]:
    """The tier's own filter: keeps the chunks read from the cpu tier at least once."""
    return [c.uses >= 1 for _, c in jobs]


def head_ghost_used(ghost_budget: int) -> Decide:
    """Returns the filter keeping the head `HEAD_SHARE` of each request's new chunks, a chunk
    evicted before (a bounded ghost of evicted blocks), and a chunk used in cpu."""
    ghost: OrderedDict[int, None] = OrderedDict()

    def decide(jobs: list[tuple[int, Chunk]], tiers: Tiers) -> list[bool]:
        out = []
        for b, c in jobs:
            seen = b in ghost
            ghost[b] = None
            ghost.move_to_end(b)
            if len(ghost) > ghost_budget:
                ghost.popitem(last=False)
            out.append(c.rank < 0 or c.rank < HEAD_SHARE * c.stored or seen or c.uses >= 1)
        return out
    return decide


def features(requests: Sequence[Request], ctx: Context, c: Chunk, now: int, evictions: int) -> list[float]:
    """Returns what is known online of chunk `c` evicted at request `now` (evicted `evictions` times before)."""
    q = c.request
    return [ctx.turn[q], ctx.gap[q], ctx.lead[q], c.pos, len(requests[q].blocks), len(requests[q].blocks) - 1 - c.pos,
            c.rank, c.stored, c.stored - 1 - c.rank if c.rank >= 0 else -1, c.rank / c.stored if c.rank >= 0 else -1,
            c.uses, requests[q].input_length, now - c.stored_at, now - c.last_use, evictions]


def learned(requests: Sequence[Request], ctx: Context, cpu: int, disk: int,
            shares: Sequence[float]) -> dict[str, float]:
    """Returns per share kept the learned filter's hit rate over write-through's and times fewer
    disk bytes, on the second half, fitted on the first half's demotions."""
    import numpy as np
    from sklearn.ensemble import HistGradientBoostingClassifier

    half = len(requests) // 2
    rows: list[list[float]] = []
    last_row: dict[int, int] = {}
    read_back: set[int] = set()
    evictions: dict[int, int] = defaultdict(int)

    def label(jobs: list[tuple[int, Chunk]], tiers: Tiers) -> list[bool]:
        for b, c in jobs:
            if tiers.now < half:
                last_row[b] = len(rows)
                rows.append(features(requests, ctx, c, tiers.now, evictions[b]))
            evictions[b] += 1
        return [True] * len(jobs)

    def hit(block: int, t: int, tokens: int) -> None:
        if block in last_row:
            read_back.add(last_row.pop(block))

    replay(requests, cpu, disk, "demote", label, on_disk_hit=hit)
    x = np.array(rows, dtype=float)
    y = np.array([i in read_back for i in range(len(rows))])
    model = HistGradientBoostingClassifier(max_iter=300, max_leaf_nodes=63, random_state=0).fit(x, y)
    scores = model.predict_proba(x)[:, 1]
    write = replay(requests, cpu, disk, "write", start=half)
    out: dict[str, float] = {"read back": float(y.mean())}
    for share in shares:
        threshold = float(np.quantile(scores, 1 - share))
        evictions.clear()

        def decide(jobs: list[tuple[int, Chunk]], tiers: Tiers, threshold: float = threshold) -> list[bool]:
            p = model.predict_proba(np.array([features(requests, ctx, c, tiers.now, evictions[b]) for b, c in jobs],
                                             dtype=float))[:, 1]
            kept: set[int] = set()
            keep = []
            for (b, c), score in zip(jobs, p):
                evictions[b] += 1
                k = score >= threshold and (c.parent is None or c.pos == 0 or c.parent in tiers.disk
                                            or c.parent in tiers.cpu or c.parent in kept)
                if k:
                    kept.add(b)
                keep.append(bool(k))
            return keep

        seen = replay(requests, cpu, disk, "demote", decide, start=half)
        out[f"top {share:.0%} hit"] = seen.rate / write.rate
        out[f"top {share:.0%} fewer"] = write.disk_tokens / max(seen.disk_tokens, 1)
    return out


def run(requests: Sequence[Request], pairs: Iterable[tuple[float, float]], learned_pairs: Iterable[tuple[float, float]],
        shares: Sequence[float]) -> list[dict]:
    """Returns per (cpu, disk) capacity each filter's hit rate over write-through's and times
    fewer disk bytes, on the second half of `requests`."""
    ctx = Context.of(requests)
    distinct = len({b for r in requests for b in r.blocks})
    block = requests[0].block_size
    half = len(requests) // 2
    fit = set(learned_pairs)
    rows = []
    for cpu_share, disk_share in pairs:
        cpu, disk = int(distinct * cpu_share) * block, int(distinct * disk_share) * block
        t0 = time.perf_counter()
        write = replay(requests, cpu, disk, "write", start=half)
        row: dict = {"cpu share": cpu_share, "disk share": disk_share, "write hit rate": round(write.rate, 4)}
        filters: dict[str, Decide | None] = {
            "none": None, "oracle": oracle(ctx), "used in cpu": used_in_cpu,
            f"head {HEAD_SHARE:.0%}, ghost or used": head_ghost_used(int(distinct * disk_share)),
        }
        for name, decide in filters.items():
            seen = replay(requests, cpu, disk, "demote", decide, start=half)
            row[name] = {"hit": round(seen.rate / write.rate, 3),
                         "fewer": round(write.disk_tokens / max(seen.disk_tokens, 1), 2)}
        if (cpu_share, disk_share) in fit:
            got = learned(requests, ctx, cpu, disk, shares)
            row["learned read back"] = round(got["read back"], 3)
            for share in shares:
                row[f"learned top {share:.0%}"] = {"hit": round(got[f"top {share:.0%} hit"], 3),
                                                   "fewer": round(got[f"top {share:.0%} fewer"], 2)}
        row["s"] = round(time.perf_counter() - t0, 1)
        print(f"{cpu_share:.0%} + {disk_share:.0%}: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
        rows.append(row)
    return rows


def meets(cell: dict) -> bool:
    """Returns whether a filter's figures meet the target: >= 0.98x write-through's hit rate, >= 2x fewer bytes."""
    return cell["hit"] >= 0.98 and cell["fewer"] >= 2.0


def render(results: dict) -> str:
    rows = results["rows"]
    names = list(dict.fromkeys(k for r in rows for k in r if isinstance(r[k], dict)))
    lines = ["# Demotion filters on a production trace", "",
             f"Mooncake's {results['trace']} trace ({results['requests']} requests; figures on its second half), "
             "a cpu tier over a disk tier, both LRU (benchmarks/bench_demotion.py, `make bench-demotion`): each "
             "filter's hit rate over write-through's / times fewer bytes written to the disk tier. Target: >= 0.98 "
             f"and >= 2x (**bold**: met). One run: {results['date']}.", "",
             "| cpu + disk capacity | write-through hit rate | " + " | ".join(names) + " |",
             "|---|---:|" + "---|" * len(names)]
    for r in rows:
        cells = []
        for n in names:
            c = r.get(n)
            text = "-" if c is None else f"{c['hit']:.3f} / {c['fewer']:.2f}x"
            cells.append(f"**{text}**" if c is not None and meets(c) else text)
        lines.append(f"| {r['cpu share']:.0%} + {r['disk share']:.0%} | {r['write hit rate']:.3f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Of the chunks plain demotion writes in the first half, the share read back from the disk: "
              + ", ".join(f"{r['learned read back']:.3f} at {r['cpu share']:.0%} + {r['disk share']:.0%}"
                          for r in rows if "learned read back" in r) + ".", ""]
    return "\n".join(lines)


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="conversation")
    ap.add_argument("--quick", action="store_true", help="the first 3,000 requests, two capacities, no learned filter")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "demotion_filters"))
    args = ap.parse_args(None if argv is None else list(argv))
    requests = load_trace(args.trace)
    if args.quick:
        requests = requests[:3000]
    rows = run(requests, PAIRS[1:4:2] if args.quick else PAIRS, () if args.quick else LEARNED_PAIRS, LEARNED_SHARES)
    results = {"date": time.strftime("%Y-%m-%d"), "quick": args.quick, "trace": args.trace,
               "requests": len(requests), "rows": rows}
    out = Path(args.out + ("_quick" if args.quick else ""))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    md = render(results)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
