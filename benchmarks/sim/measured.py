"""Simulator parameters taken from figures measured on this machine (benchmarks/results/).

Every field says which figure feeds it. The engine's step time is a least-squares fit over
bench_engine's prefill, decode and prefix-cache rows; tier load speeds come from bench_ttft's
warm long-document loads (end to end: fetch, decode, scatter into the pool); the cache
server's per-shard capacity from bench_server's server-CPU and latency rows."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parents[1] / "results"
SMOLLM_FP32_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # the model every results file measured


@dataclass(frozen=True)
class StepFit:
    """One engine step's seconds: a0 + b_prefill * prefill tokens + b_decode * decoding requests
    + k_attn * sum over requests of (new tokens x tokens attended). `scale` multiplies it all
    (another thread count or another machine)."""

    a0: float
    b_prefill: float
    b_decode: float
    k_attn: float
    scale: float = 1.0

    def step_s(self, prefill_tokens: int, decodes: int, attn: float) -> float:
        """Returns the seconds of one step with these amounts of work."""
        return self.scale * (self.a0 + self.b_prefill * prefill_tokens + self.b_decode * decodes + self.k_attn * attn)

    def prefill_s(self, new_tokens: int, cached: int = 0, budget: int = 2048) -> float:
        """Returns the seconds to prefill `new_tokens` after `cached` ones, alone, `budget` per step."""
        secs, done = 0.0, cached
        while done < cached + new_tokens:
            n = min(budget, cached + new_tokens - done)
            secs += self.step_s(n, 0, n * (done + n / 2))
            done += n
        return secs


@dataclass(frozen=True)
class ShardCapacity:
    """What one shard (a cache-server process or a Redis primary: one core each) sustains."""

    name: str
    gbps: float  # bytes in + out per second the shard's core can serve
    ops_per_s: float  # requests per second, from one request's round trip (conservative)
    source: str


@dataclass(frozen=True)
class Measured:
    """Everything the simulator takes from the results files, with where each came from."""

    step: StepFit
    load_gbps: dict[str, float]  # tier kind -> end-to-end load speed into the pool (GB/s)
    shards: dict[str, ShardCapacity]
    fit_check: list[dict[str, float]] = field(default_factory=list)  # measured vs fitted
    sources: dict[str, str] = field(default_factory=dict)


def _read(name: str, results: Path) -> dict:
    path = results / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run benchmarks/bench_{name}.py first")
    return json.loads(path.read_text())


def fit_step(engine: dict) -> tuple[StepFit, list[dict[str, float]]]:
    """Returns the step-time fit over bench_engine's rows (relative least squares) and each
    row's measured vs fitted seconds."""
    budget = 2048  # the engine's default --max-num-batched-tokens: longer prefills take more steps
    rows: list[tuple[str, list[float], float]] = []
    for p in engine["prefill"]:
        n = p["tokens"]
        rows.append((f"prefill {n}", [float(-(-n // budget)), n, 0, n * n / 2], p["engine_s"]))
    for d in engine["decode"]:  # 64-token prompts decoding 64 tokens: ~96 tokens attended
        b = d["batch"]
        rows.append((f"decode batch {b} (step)", [1, 0, b, b * 96], b / d["engine_tok_s"]))
    t = engine["ttft"]
    new = t["tokens"] - t["cached_tokens"]
    rows.append((f"prefix-cache hit ({t['cached_tokens']} cached)", [1, new, 0, new * (t["cached_tokens"] + new / 2)],
                 t["warm_ttft_s"]))
    a = np.array([r[1] for r in rows])
    y = np.array([r[2] for r in rows])
    coef, *_ = np.linalg.lstsq(a / y[:, None], np.ones_like(y), rcond=None)
    coef = np.maximum(coef, 0.0)
    check = [{"row": name, "measured_s": m, "fitted_s": float(np.dot(x, coef))} for name, x, m in rows]
    return StepFit(float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3])), check


def load_measured(results: Path = RESULTS) -> Measured:
    """Returns the parameters from results/{engine,ttft,store,server}.json (FileNotFoundError
    naming the missing file)."""
    engine, ttft, server = _read("engine", results), _read("ttft", results), _read("server", results)
    step, check = fit_step(engine)
    ld = ttft["long_doc_qa"]
    doc, q = ld["doc_tokens"], ld["question_tokens"]
    question_s = step.step_s(q, 0, q * (doc + q / 2))
    nbytes = doc * SMOLLM_FP32_BYTES_PER_TOKEN
    load_gbps = {kind: nbytes / max(t["warm_ttft_s"] - question_s, 1e-3) / 1e9 for kind, t in ld["tiers"].items()}
    rows = {r["metric"]: r for r in server["rows"]}
    get_ratio = rows["GET chunk, tier API (serde included)"]["ratio"]  # cache server over Redis
    if "redis" in load_gbps:  # the cache server: Redis's end-to-end load, sped up by its GET ratio
        load_gbps["kvtier"] = load_gbps["redis"] * get_ratio
    shards = {}
    for kind, col in (("kvtier", "kvtier"), ("redis", "redis")):
        cpu_s_per_gb = (rows["PUT, server CPU per GB"][col] + rows["GET, server CPU per GB"][col]) / 2
        ops = 1e6 / rows["EXISTS (1 key) p50"][col]
        shards[kind] = ShardCapacity(kind, 1.0 / cpu_s_per_gb, ops,
                                     f"server.json: 1 / mean(PUT, GET server CPU s/GB) = {1 / cpu_s_per_gb:.2f} GB/s; "
                                     f"1 / EXISTS p50 = {ops:.0f} ops/s")
    sources = {
        "step": "engine.json: prefill 1024/4096, decode batch 1/8/32, prefix-cache warm TTFT (threads=2, fp32)",
        "load_gbps": f"ttft.json long_doc_qa: {doc}-token warm TTFT per tier minus the fitted {q}-token "
                     f"question step ({question_s * 1e3:.0f} ms), over {nbytes / 1e6:.0f} MB",
        "load_gbps[kvtier]": f"load_gbps[redis] x server.json GET tier-API ratio kvtier/redis ({get_ratio:.2f})",
        "shards": "server.json (one client, loopback; server CPU per GB and EXISTS p50)",
    }
    return Measured(step, load_gbps, shards, check, sources)
