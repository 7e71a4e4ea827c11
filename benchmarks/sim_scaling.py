"""Sizing by simulation: hit rate, TTFT and shared-tier shards for N engines (docs/scaling.md).

A trace of multi-round QA sessions on Zipf-popular shared documents is routed over N engines
(kv-aware, prefix-hash or round-robin); each engine is simulated step by step with the step
times, tier load speeds and shard capacities measured here (benchmarks/results/, see
benchmarks/sim/measured.py for which figure feeds which parameter).

    .venv/bin/python -m benchmarks.sim_scaling --engines 8 --rate 2 --model llama-3-8b \\
        --pool-gib 40 --tier cpu:64GiB --tier kvtier:1TiB [--json out.json]

`--rate` is requests/s per engine (the fleet gets N x rate). Prints one row per policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from benchmarks.sim.engine_sim import EngineConfig
from benchmarks.sim.measured import Measured, StepFit, load_measured
from benchmarks.sim.model_kv import PRESETS, ModelKV, resolve
from benchmarks.sim.simulate import POLICIES, SimResult, TierSpec, simulate
from benchmarks.sim.sizing import ShardAssumptions, size_tier
from benchmarks.sim.trace import Workload, ideal_reuse, make_trace

UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "": 1}
SHARED_KINDS = ("kvtier", "redis")  # the cache server and Redis Cluster: one store for all engines


def parse_bytes(text: str) -> int:
    """Returns the bytes of '4GiB', '512MiB' or a plain integer; ValueError naming the text."""
    for unit in ("KiB", "MiB", "GiB", "TiB", ""):
        if text.endswith(unit):
            try:
                return int(float(text[: len(text) - len(unit)] if unit else text) * UNITS[unit])
            except ValueError:
                break
    raise ValueError(f"bad size {text!r}: use e.g. 512MiB, 4GiB, 1TiB")


def parse_tier(text: str, measured: Measured) -> TierSpec:
    """Returns the TierSpec of 'KIND:BUDGET[:GBPS]' (cpu, disk: one per engine; kvtier, redis:
    shared); GBPS replaces the measured load speed (another network or device)."""
    kind, _, rest = text.partition(":")
    budget, _, gbps = rest.partition(":")
    if kind not in measured.load_gbps:
        raise ValueError(f"bad tier {text!r}: kind must be one of {', '.join(measured.load_gbps)}")
    if not budget:
        raise ValueError(f"bad tier {text!r}: give a budget, e.g. {kind}:64GiB")
    try:
        speed = float(gbps) if gbps else measured.load_gbps[kind]
    except ValueError:
        raise ValueError(f"bad tier {text!r}: load speed {gbps!r} is not a number of GB/s") from None
    if speed <= 0:
        raise ValueError(f"bad tier {text!r}: load speed must be > 0")
    return TierSpec(kind, parse_bytes(budget), speed, kind in SHARED_KINDS)


def parse_step_fit(text: str) -> StepFit:
    """Returns the StepFit of 'a0,b_prefill,b_decode,k_attn' (seconds)."""
    try:
        a0, bp, bd, k = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"bad --step-fit {text!r}: four numbers a0,b_prefill,b_decode,k_attn") from None
    return StepFit(a0, bp, bd, k)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sim_scaling", description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--rate", type=float, default=0.2, help="requests/s per engine")
    ap.add_argument("--policy", action="append", choices=POLICIES, help="repeatable (default: all three)")
    ap.add_argument("--model", default="smollm2-135m", help=f"preset ({', '.join(PRESETS)}) or a config.json path")
    ap.add_argument("--dtype", default=None, help="KV dtype (default: the preset's / config's)")
    pool = ap.add_mutually_exclusive_group()
    pool.add_argument("--pool-blocks", type=int, help="KV pool per engine in blocks")
    pool.add_argument("--pool-gib", type=float, help="KV pool per engine in GiB (default 1)")
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--tier", action="append", default=[], metavar="KIND:BUDGET[:GBPS]",
                    help="cpu/disk (per engine) or kvtier/redis (shared); repeatable, fastest first; "
                         "GBPS overrides the measured load speed")
    w = Workload()
    ap.add_argument("--users", type=int, default=None,
                    help="sessions (default: enough that the rate holds for most of the trace, >= 24 per engine)")
    ap.add_argument("--rounds", type=int, default=w.rounds)
    ap.add_argument("--docs", type=int, default=w.docs, help="shared documents (0: each user its own)")
    ap.add_argument("--zipf", type=float, default=w.zipf_s)
    ap.add_argument("--doc-tokens", type=int, default=w.doc_tokens)
    ap.add_argument("--question-tokens", type=int, default=w.question_tokens)
    ap.add_argument("--answer-tokens", type=int, default=w.answer_tokens)
    ap.add_argument("--think-s", type=float, default=w.think_s)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-fit", default=None, help="a0,b_prefill,b_decode,k_attn seconds (default: measured here)")
    ap.add_argument("--compute-scale", type=float, default=1.0, help="multiplies every step time")
    ap.add_argument("--load-scale", type=float, default=1.0, help="multiplies every tier's load speed")
    a = ShardAssumptions()
    ap.add_argument("--nic-gbps", type=float, default=a.nic_gbps, help="GB/s one shard's network carries")
    ap.add_argument("--utilization", type=float, default=a.utilization, help="target fraction of shard capacity")
    ap.add_argument("--shard-memory-gib", type=float, default=a.memory_gib)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    return ap


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One sizing question: the fleet, the workload and the tiers."""

    engines: int
    policies: tuple[str, ...]
    model: ModelKV
    engine: EngineConfig
    workload: Workload
    tiers: tuple[TierSpec, ...]
    step: StepFit
    shard: ShardAssumptions


def scenario_from_args(args: argparse.Namespace, measured: Measured) -> Scenario:
    """Returns the scenario the flags describe; ValueError naming the first bad flag."""
    if args.engines < 1:
        raise ValueError(f"--engines must be >= 1, got {args.engines}")
    model = resolve(args.model, args.dtype)
    block_bytes = model.bytes_per_token * args.block_tokens
    blocks = args.pool_blocks or int((args.pool_gib or 1.0) * 2**30 // block_bytes)
    if blocks < 1:
        raise ValueError("the KV pool holds no block: raise --pool-gib / --pool-blocks")
    engine = EngineConfig(blocks, args.block_tokens, args.chunk_tokens, args.max_num_seqs, args.max_batched_tokens)
    fleet_rate = args.rate * args.engines
    # Sessions ramp up and down over about rounds x think_s; four times that span of session
    # starts keeps the nominal rate for most of the trace.
    steady = math.ceil(4 * (args.rounds - 1) * args.think_s * fleet_rate / args.rounds)
    users = args.users if args.users is not None else max(24 * args.engines, steady)
    workload = Workload(users, args.rounds, args.docs, args.zipf, args.doc_tokens, args.question_tokens,
                        args.answer_tokens, args.think_s, fleet_rate, args.seed)
    workload.validate()
    tiers = tuple(dataclasses.replace(t, load_gbps=t.load_gbps * args.load_scale)
                  for t in (parse_tier(x, measured) for x in args.tier))
    step = parse_step_fit(args.step_fit) if args.step_fit else measured.step
    step = dataclasses.replace(step, scale=args.compute_scale)
    shard = ShardAssumptions(args.nic_gbps, args.utilization, args.shard_memory_gib)
    return Scenario(args.engines, tuple(args.policy or POLICIES), model, engine, workload, tiers, step, shard)


def run(sc: Scenario, measured: Measured) -> dict[str, Any]:
    """Simulates every policy of `sc`; returns the JSON-able results (inputs included)."""
    trace = make_trace(sc.workload)
    out: dict[str, Any] = {
        "inputs": {"engines": sc.engines, "model": dataclasses.asdict(sc.model),
                   "kv_bytes_per_token": sc.model.bytes_per_token, "engine": dataclasses.asdict(sc.engine),
                   "workload": dataclasses.asdict(sc.workload), "tiers": [dataclasses.asdict(t) for t in sc.tiers],
                   "step_fit": dataclasses.asdict(sc.step), "shard_assumptions": dataclasses.asdict(sc.shard)},
        "measured_sources": measured.sources, "step_fit_check": measured.fit_check,
        "trace": {"requests": len(trace), "ideal_reuse": ideal_reuse(trace, sc.engine.block_tokens),
                  "mean_rate": len(trace) / max(trace[-1].arrival_s - trace[0].arrival_s, 1e-9)},
        "policies": {},
    }
    for policy in sc.policies:
        res = simulate(trace, policy, sc.engines, sc.engine, sc.step, list(sc.tiers), sc.model.bytes_per_token)
        out["policies"][policy] = summarize(res, sc.workload.rate, measured, sc.shard)
    return out


def summarize(res: SimResult, rate: float, measured: Measured, a: ShardAssumptions) -> dict[str, Any]:
    """Returns one policy's figures: hit rates, TTFT and, per shared tier, the shards it needs
    at `rate` requests/s (the fleet's)."""
    row: dict[str, Any] = {"all": res.summary(), "follow_up": res.summary(skip_first_round=True),
                           "requests_per_engine": res.per_engine, "duration_s": res.duration_s, "shared_tiers": {}}
    for tier in res.shared:
        s = size_tier(tier, len(res.lives), rate, measured.shards[tier.name], a)
        row["shared_tiers"][tier.name] = {**dataclasses.asdict(s), "shards": s.shards,
                                          "capacity_source": measured.shards[tier.name].source}
    return row


def table(out: dict[str, Any]) -> str:
    """Returns the results as a markdown table, one row per policy."""
    lines = ["| policy | hit rate (engine + tier) | engine hit | tier hit (of engine misses) | TTFT mean | "
             "TTFT p99 | shared-tier GB/s read / write | ops/s | shards (bw / ops / mem) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for policy, r in out["policies"].items():
        s = r["all"]
        shards = "; ".join(f"{k}: {t['shards']} ({t['shards_bandwidth']}/{t['shards_ops']}/{t['shards_memory']})"
                           for k, t in r["shared_tiers"].items()) or "-"
        rw = "; ".join(f"{t['read_gbps']:.2f} / {t['write_gbps']:.2f}" for t in r["shared_tiers"].values()) or "-"
        ops = "; ".join(f"{t['ops_per_s']:.0f}" for t in r["shared_tiers"].values()) or "-"
        lines.append(f"| {policy} | {s['hit_rate']:.3f} | {s['engine_hit_rate']:.3f} | {s['tier_hit_rate']:.3f} | "
                     f"{s['ttft_mean_s'] * 1e3:.0f} ms | {s['ttft_p99_s'] * 1e3:.0f} ms | {rw} | {ops} | {shards} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        measured = load_measured()
        sc = scenario_from_args(args, measured)
        out = run(sc, measured)
    except (ValueError, FileNotFoundError) as exc:
        print(f"sim_scaling: {exc}", file=sys.stderr)
        return 2
    print(f"{sc.engines} engines x {sc.model.name} ({sc.model.bytes_per_token} B/token KV, "
          f"{sc.engine.pool_blocks} blocks each), {sc.workload.rate:g} req/s in all "
          f"({out['trace']['mean_rate']:.2f} averaged over the trace with its ramps; shards are sized at "
          f"{sc.workload.rate:g}), {out['trace']['requests']} requests, "
          f"ideal reuse {out['trace']['ideal_reuse']:.2f}")
    print(table(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
