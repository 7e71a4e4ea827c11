"""Validation of the sizing simulator against one real two-instance run here.

Two `kvtier serve` processes (one torch thread each: OMP_NUM_THREADS=1) share a
`kvtier cache-server` behind `kvtier router`; a multi-round QA trace from the simulator's
generator is replayed open-loop once per policy (fresh processes, empty caches). The
simulator predicts the same trace on the same flags, twice: with the parameters of
benchmarks/results/ as they are (measured with two threads), and calibrated by probe
requests of this run (cold prefills on both engines at once set the compute scale, a load
from the cache server its load speed), probed before and after each policy's replay.
Writes benchmarks/results/scaling_validation.{json,md}.

    .venv/bin/python -m benchmarks.sim.validate [--policies kv-aware,round-robin] [--rate 0.3]
        [--suffix _name] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.sim.engine_sim import EngineConfig
from benchmarks.sim.live_run import Fleet, LiveFleet, Prompts, complete, replay, scrape
from benchmarks.sim.measured import SMOLLM_FP32_BYTES_PER_TOKEN, Measured, StepFit, load_measured
from benchmarks.sim.simulate import TierSpec, simulate
from benchmarks.sim.trace import Request, Workload, make_trace

RESULTS = Path(__file__).resolve().parents[1] / "results"


def probe(fleet: LiveFleet, doc_tokens: int, seed: int) -> dict[str, float]:
    """Times requests outside the trace: cold prompts on both backends at once (two pairs:
    the speed of an engine while the other computes too, as under load), then one of backend
    0's prompts on backend 1 (loaded from the cache server; its tier counters give the load
    speed) and again there (its own prefix cache). Resets both prefix caches afterwards."""
    prompts = Prompts(seed, doc_tokens + 32, 0)
    reqs = [Request(i, 0.0, -1 - i, 0, -1 - i, doc_tokens + 32, 0, 1) for i in range(4)]
    a, b = fleet.backends

    async def go() -> dict[str, float]:
        async with httpx.AsyncClient(timeout=600) as c:
            for url in (a, b):  # a first request pays one-time costs: keep it out of the figures
                await complete(c, url, [7, 8, 9], 1)
            cold = []
            for q0, q1 in ((reqs[0], reqs[1]), (reqs[2], reqs[3])):
                cold += await asyncio.gather(complete(c, a, prompts.of(q0), 1), complete(c, b, prompts.of(q1), 1))
            await asyncio.sleep(2.0)  # stores reach the cache server in the background
            t0 = await asyncio.to_thread(scrape, b)
            tier = await complete(c, b, prompts.of(reqs[0]), 1)
            t1 = await asyncio.to_thread(scrape, b)
            own = await complete(c, b, prompts.of(reqs[0]), 1)
            for url in (a, b):
                await c.post(f"{url}/kv/reset_prefix_cache")

        def delta(k: str) -> float:
            return t1.get(k, 0.0) - t0.get(k, 0.0)

        return {"prompt_tokens": doc_tokens + 32, "cold_ttft_s": statistics.median(x["ttft_s"] for x in cold),
                "tier_ttft_s": tier["ttft_s"], "tier_cached_tokens": tier["cached_tokens"],
                "tier_loaded_bytes": delta("kvtier:kv_tier_loaded_bytes_total"),
                "tier_load_s": delta("kvtier:kv_tier_load_seconds_total"),
                "engine_ttft_s": own["ttft_s"], "engine_cached_tokens": own["cached_tokens"]}

    return asyncio.run(go())


def calibrate(m: Measured, p: dict[str, float]) -> tuple[StepFit, float, dict[str, float]]:
    """Returns the step fit scaled to the probes' cold prefills, the cache server's load speed
    (GB/s: the serve process's own tier counters over the probe's load), and the numbers
    behind both."""
    n = int(p["prompt_tokens"])
    scale = p["cold_ttft_s"] / m.step.prefill_s(n)
    step = dataclasses.replace(m.step, scale=scale)
    gbps = p["tier_loaded_bytes"] / max(p["tier_load_s"], 1e-6) / 1e9
    cached = int(p["engine_cached_tokens"])
    return step, gbps, {"compute_scale": scale, "kvtier_load_gbps": gbps,
                        "predicted_engine_hit_ttft_s": step.prefill_s(n - cached, cached)}


def measured_summary(rows: list[dict[str, Any]], counters: list[dict[str, float]]) -> dict[str, float]:
    """Returns the real run's figures in the simulator's terms."""
    prompt = sum(r["prompt_tokens"] for r in rows)
    own = sum(c.get("kvtier:prefix_cache_hits_total", 0.0) for c in counters)
    loaded = sum(c.get("kvtier:kv_connector_hit_tokens_total", 0.0) for c in counters)
    ttft = sorted(r["ttft_s"] for r in rows)
    per_engine = [c.get("kvtier:prompt_tokens_total", 0.0) for c in counters]
    return {"requests": len(rows), "hit_rate": sum(r["cached_tokens"] for r in rows) / prompt,
            "engine_hit_rate": own / prompt, "tier_hit_rate": loaded / max(prompt - own, 1),
            "ttft_mean_s": statistics.mean(ttft), "ttft_p50_s": statistics.median(ttft),
            "ttft_p99_s": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
            "max_engine_share": max(per_engine) / max(sum(per_engine), 1.0)}


def predict(trace: list[Request], policy: str, fleet: Fleet, step: StepFit, kvtier_gbps: float) -> dict[str, float]:
    cfg = EngineConfig(fleet.pool_blocks, max_num_seqs=fleet.max_num_seqs)
    tiers = [TierSpec("kvtier", fleet.cache_bytes, kvtier_gbps, shared=True)]
    return simulate(trace, policy, 2, cfg, step, tiers, SMOLLM_FP32_BYTES_PER_TOKEN).summary()


KEYS = [("hit_rate", "hit rate (engine + tier)", 1.0, ".3f"),
        ("engine_hit_rate", "engine prefix-cache hit", 1.0, ".3f"),
        ("tier_hit_rate", "tier hit (of engine misses)", 1.0, ".3f"), ("ttft_mean_s", "TTFT mean (ms)", 1e3, ".0f"),
        ("ttft_p50_s", "TTFT p50 (ms)", 1e3, ".0f"), ("ttft_p99_s", "TTFT p99 (ms)", 1e3, ".0f"),
        ("max_engine_share", "busiest engine's share", 1.0, ".2f")]


def table(res: dict[str, Any]) -> str:
    lines = ["| policy | figure | measured | predicted (calibrated) | predicted / measured | "
             "predicted (results files as-is) |", "|---|---|---:|---:|---:|---:|"]
    for policy, arm in res["arms"].items():
        for key, label, mul, fmt in KEYS:
            m, p, raw = arm["measured"][key], arm["predicted"][key], arm["predicted_uncalibrated"][key]
            ratio = f"{p / m:.2f}" if m else "-"
            lines.append(f"| {policy} | {label} | {m * mul:{fmt}} | {p * mul:{fmt}} | {ratio} | {raw * mul:{fmt}} |")
    lines += ["", "| ratio kv-aware over round-robin | measured | predicted |", "|---|---:|---:|"]
    for key, val in res.get("policy_ratios", {}).items():
        lines.append(f"| {key} | {val['measured']:.2f} | {val['predicted']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="kv-aware,round-robin,prefix-hash")
    ap.add_argument("--quick", action="store_true", help="a tiny trace (checks the harness)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--rate", type=float, default=0.3, help="requests/s of the trace, both engines together")
    ap.add_argument("--suffix", default="", help="results go to scaling_validation<SUFFIX>.{json,md}")
    args = ap.parse_args()
    from engine.default_model import ensure_default_model

    model = args.model or str(ensure_default_model())
    # Pools hold about two documents' sessions: where a follow-up lands decides its engine hit.
    w = Workload(users=16, rounds=3, docs=8, zipf_s=0.8, doc_tokens=768, question_tokens=32, answer_tokens=16,
                 think_s=15.0, rate=args.rate, seed=3)
    if args.quick:
        w = dataclasses.replace(w, users=3, rounds=2, doc_tokens=256, think_s=2.0, rate=1.0)
    fleet = Fleet(pool_blocks=160, max_num_seqs=4, cache_bytes=1 << 30)
    trace = make_trace(w)
    measured = load_measured()
    res: dict[str, Any] = {"platform": platform.platform(), "workload": dataclasses.asdict(w),
                           "fleet": dataclasses.asdict(fleet), "requests": len(trace), "arms": {},
                           "measured_sources": measured.sources}
    for i, policy in enumerate(args.policies.split(",")):
        print(f"{policy} ...", file=sys.stderr)
        live = LiveFleet(fleet, policy, model)
        try:
            # Probes before and after the replay: the host's other load moves the compute scale.
            probes = [probe(live, w.doc_tokens, 1000 * (i + 1))]
            before = [scrape(u) for u in live.backends]
            load_before = os.getloadavg()
            t0 = time.perf_counter()
            rows = asyncio.run(replay(live.router, trace, Prompts(w.seed, w.doc_tokens,
                                                                  w.rounds * (w.question_tokens + w.answer_tokens))))
            wall = time.perf_counter() - t0
            counters = [{k: v - b.get(k, 0.0) for k, v in scrape(u).items()} for u, b in zip(live.backends, before)]
            load_after = os.getloadavg()
            probes.append(probe(live, w.doc_tokens, 1000 * (i + 1) + 500))
        finally:
            live.stop()
        merged = {k: statistics.mean(p[k] for p in probes) for k in probes[0]}
        merged["tier_cached_tokens"] = min(p["tier_cached_tokens"] for p in probes)
        merged["engine_cached_tokens"] = min(p["engine_cached_tokens"] for p in probes)
        step, gbps, info = calibrate(measured, merged)
        res["arms"][policy] = {
            "wall_s": wall, "loadavg_1m_before_after": [load_before[0], load_after[0]],
            "calibration": {"probes": probes, **merged, **info},
            "measured": measured_summary(rows, counters), "rows": rows, "counters": counters,
            "predicted": predict(trace, policy, fleet, step, gbps),
            "predicted_uncalibrated": predict(trace, policy, fleet, measured.step, measured.load_gbps["kvtier"]),
        }
    arms = res["arms"]
    if "kv-aware" in arms and "round-robin" in arms:
        res["policy_ratios"] = {
            f"{label} (round-robin / kv-aware)": {
                k: arms["round-robin"][src][key] / max(arms["kv-aware"][src][key], 1e-9)
                for k, src in (("measured", "measured"), ("predicted", "predicted"))}
            for key, label in (("ttft_mean_s", "TTFT mean"), ("ttft_p99_s", "TTFT p99"))}
        res["policy_ratios"]["engine hit rate (kv-aware / round-robin)"] = {
            k: arms["kv-aware"][src]["engine_hit_rate"] / max(arms["round-robin"][src]["engine_hit_rate"], 1e-9)
            for k, src in (("measured", "measured"), ("predicted", "predicted"))}
    md = table(res)
    name = "scaling_validation" + ("_quick" if args.quick else args.suffix)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=2) + "\n")
    calib = "\n".join(
        f"- {policy}: cold {c['prompt_tokens']:.0f}-token prefill {c['cold_ttft_s'] * 1e3:.0f} ms -> compute scale "
        f"{c['compute_scale']:.2f} x the results-file fit; cache-server load {c['kvtier_load_gbps']:.2f} GB/s "
        f"(results files: {measured.load_gbps['kvtier']:.2f}); engine-hit TTFT {c['engine_ttft_s'] * 1e3:.0f} ms "
        f"(predicted {c['predicted_engine_hit_ttft_s'] * 1e3:.0f}); host load average (1 min) "
        f"{a['loadavg_1m_before_after'][0]:.1f} -> {a['loadavg_1m_before_after'][1]:.1f} on 2 cores"
        for policy, a in res["arms"].items() for c in [a["calibration"]])
    (RESULTS / f"{name}.md").write_text(
        f"# Simulator vs a real two-instance run\n\n2 x `kvtier serve` (SmolLM2-135M fp32, cpu, 1 torch thread each, "
        f"{fleet.pool_blocks} KV blocks, max {fleet.max_num_seqs} seqs) sharing a `kvtier cache-server` "
        f"({fleet.cache_bytes >> 20} MiB) behind `kvtier router`; trace: {w.users} users x {w.rounds} rounds on "
        f"{w.docs} Zipf({w.zipf_s}) documents of {w.doc_tokens} tokens, {w.question_tokens}-token questions, "
        f"{w.answer_tokens}-token answers, think {w.think_s:g} s, {w.rate:g} req/s open-loop "
        f"({len(trace)} requests per policy; fresh processes and caches per policy).\n\n"
        f"Calibration per policy (probe requests outside the trace, before and after it, averaged):\n\n"
        f"{calib}\n\n{md}\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
