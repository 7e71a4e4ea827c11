"""The discrete-event loop: requests arrive from a trace, a routing policy picks an engine,
engines step; returns per-request outcomes and tier traffic."""

from __future__ import annotations

import heapq
import itertools
import zlib
from dataclasses import dataclass, field

import numpy as np

from benchmarks.sim.cache import ChunkTier
from benchmarks.sim.engine_sim import EngineConfig, Live, SimEngine
from benchmarks.sim.measured import StepFit
from benchmarks.sim.trace import Request

POLICIES = ("kv-aware", "prefix-hash", "round-robin")


@dataclass(frozen=True)
class TierSpec:
    """A tier: `kind` picks its measured load speed; `shared` tiers are one store for every
    engine (the cache server or Redis Cluster), the others one per engine (cpu, disk)."""

    kind: str
    budget_bytes: int
    load_gbps: float
    shared: bool
    latency_s: float = 0.0


@dataclass
class SimResult:
    """Per-request outcomes and totals of one run."""

    policy: str
    lives: list[Live]
    duration_s: float
    shared: list[ChunkTier]
    local: list[list[ChunkTier]]
    per_engine: list[int] = field(default_factory=list)
    blocks_held_at_end: int = 0  # pool references left once every request finished: must be 0

    def summary(self, skip_first_round: bool = False) -> dict[str, float]:
        """Returns hit rates (token-weighted), TTFT mean/p50/p99 and routing balance."""
        lv = [x for x in self.lives if not (skip_first_round and x.req.round == 0)]
        if not lv:
            return {}
        prompt = sum(x.req.prompt_tokens for x in lv)
        own = sum(x.engine_hit for x in lv)
        loaded = sum(x.loaded for x in lv)
        ttft = np.array([x.first_token_s - x.req.arrival_s for x in lv if x.first_token_s is not None])
        return {
            "requests": len(lv),
            "engine_hit_rate": own / prompt,
            "tier_hit_rate": loaded / max(prompt - own, 1),  # of what the engine missed
            "hit_rate": (own + loaded) / prompt,
            "ttft_mean_s": float(ttft.mean()),
            "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "max_engine_share": max(self.per_engine) / max(sum(self.per_engine), 1),
        }


def prefix_hash_order(req: Request, chunk_tokens: int, n: int) -> list[int]:
    """Returns engine indices in prefix-hash order: rendezvous hashing of the prompt's first
    chunk (as `kvtier router` does), best first."""
    keys = req.block_keys(chunk_tokens)
    head = repr(keys[0] if keys else ("u", req.user, 0))
    return sorted(range(n), key=lambda i: zlib.crc32(f"{head}/{i}".encode()), reverse=True)


def route(policy: str, req: Request, engines: list[SimEngine], rr: itertools.count) -> int:
    """Returns the engine index `policy` sends `req` to, ranked as `kvtier router` ranks."""
    if policy == "round-robin":
        return next(rr) % len(engines)
    order = prefix_hash_order(req, engines[0].cfg.chunk_tokens, len(engines))
    if policy == "prefix-hash":
        return order[0]
    if policy == "kv-aware":  # longest hit, then a hit in the engine's own cache, then load, then prefix-hash
        rank = {e: r for r, e in enumerate(order)}
        scores = []
        for e in engines:
            own, best = e.lookup(req)
            scores.append((-best, -own, e.queue_len(), rank[e.idx], e.idx))
        return min(scores)[-1]
    raise ValueError(f"unknown policy {policy!r} (one of {', '.join(POLICIES)})")


def simulate(trace: list[Request], policy: str, num_engines: int, cfg: EngineConfig, step: StepFit,
             tiers: list[TierSpec], model_bytes_per_token: int) -> SimResult:
    """Runs the trace through `num_engines` engines under `policy`; returns every request's
    outcome. Deterministic: the same inputs give the same result."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r} (one of {', '.join(POLICIES)})")
    chunk_bytes = cfg.chunk_tokens * model_bytes_per_token

    def make(t: TierSpec) -> ChunkTier:
        return ChunkTier(t.kind, t.budget_bytes, chunk_bytes, t.load_gbps, t.latency_s)

    shared = [make(t) for t in tiers if t.shared]
    local = [[make(t) for t in tiers if not t.shared] for _ in range(num_engines)]
    # The storage manager orders tiers fastest first; local tiers (cpu, disk) come before shared ones.
    engines = [SimEngine(i, cfg, step, local[i], shared) for i in range(num_engines)]
    seq = itertools.count()
    events: list[tuple[float, int, str, int, object]] = [(q.arrival_s, next(seq), "arrive", -1, q) for q in trace]
    heapq.heapify(events)
    rr = itertools.count()
    per_engine = [0] * num_engines
    done: list[Live] = []
    now = 0.0

    def kick(e: SimEngine) -> None:
        if e.busy:
            return
        secs, loads = e.schedule(now)
        for end, lv in loads:
            heapq.heappush(events, (end, next(seq), "loaded", e.idx, lv))
        if secs is not None:
            e.busy = True
            heapq.heappush(events, (now + secs, next(seq), "step", e.idx, None))

    while events:
        now, _, kind, idx, obj = heapq.heappop(events)
        if kind == "arrive":
            assert isinstance(obj, Request)
            idx = route(policy, obj, engines, rr)
            per_engine[idx] += 1
            engines[idx].waiting.append(obj)
        elif kind == "loaded":
            assert isinstance(obj, Live)
            engines[idx].load_done(obj)
        else:
            engines[idx].busy = False
            done.extend(engines[idx].finish_step(now))
        kick(engines[idx])
    stuck = sum(e.queue_len() for e in engines)
    if stuck:
        raise ValueError(f"{stuck} requests never ran: a prompt + answer needs more blocks than the pool has")
    done.sort(key=lambda x: x.req.rid)
    start = trace[0].arrival_s if trace else 0.0
    return SimResult(policy, done, now - start, shared, local, per_engine, sum(e.pool.num_held for e in engines))
