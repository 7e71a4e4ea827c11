"""Soak: hours of load with faults against `kvtier serve` (issue #29). Nothing may leak, no
answer may be wrong, and no remote call may hold a request.

Setup: `kvtier serve` (the bundled model, a small engine prefix cache: 512 blocks of 16
tokens for 8 running requests) with four tiers, fast to slow: `cpu` (32 MiB), `disk`
(256 MiB), a private redis-server and a `kvtier cache-server` (256 MiB); chunks of 128 tokens.
Load: 8 concurrent streaming clients through the openai client; the mix is multi-turn chats
that grow (40%), documents shared by every client (40%) and unique prompts (20%), 32 greedy
tokens each. Capacity is measured first (the same clients, closed loop); then each client
sends at 80% of its share of it (Poisson arrivals). Faults on a fixed schedule (30 minutes:
Redis SIGKILLed and restarted every 5 minutes; the cache server SIGSTOPped for 5 s, later
SIGKILLed and restarted, later frozen again; a value corrupted in place, twice; the disk
tier's directory filled to its budget by another process); idle points every 5 minutes, where
blocks, refs, pins and loads in flight must be 0. Runs shorter than 10 minutes do each fault
once. Afterwards every answer is checked against a server with no connector (greedy; a first
differing token the reference ranks within 0.01 nats of its best is reported as a near tie,
float noise between batch shapes, not as a wrong answer).

    .venv/bin/python -m benchmarks.soak [--minutes 30] [--name soak] [--engine kvtier|vllm]

`--engine vllm`: the same soak against `vllm serve` (vLLM's CPU build in .venv-vllm) with
kvtier's connector over the same tiers (chunks of 256 tokens) and vLLM's own prefix cache
off, so every reuse comes from the tiers; the reference is `vllm serve` without a connector
(benchmarks/soak_engines.py says which figures vLLM's /metrics has no counterpart for).
tests/kvtier/test_soak_short.py runs this same `Soak` with fewer clients, closed-loop load, one
of each fault and a fixed number of requests (`SoakConfig.requests`) instead of a length.

Writes benchmarks/results/<name>.json, <name>.md and <name>.png (the figures over time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from benchmarks import soak_parts as P
from benchmarks.soak_engines import VLLM_CHUNK_SIZE, Server, figures, start_server, unavailable
from benchmarks.soak_report import write_report
from engine.default_model import ensure_default_model
from harness.cache_server import CacheServerProcess
from harness.redis import free_port, start_redis

REPO = Path(__file__).resolve().parents[1]

RESULTS = REPO / "benchmarks" / "results"
CHUNK_SIZE = 128
SAMPLE_S = 5.0
REPLAY_CONCURRENCY = 8  # requests at a time on the reference server
RECOVERY_S = 15.0  # a fault window lasts until this long after the fault ended
# (fraction of the run, fault) for a 30-minute run; shorter than 10 minutes: one of each
FULL_PLAN = [(2.0, "redis_kill"), (3.5, "cache_freeze"), (5.0, "idle"), (6.5, "redis_kill"), (8.0, "corrupt"),
             (10.0, "idle"), (11.5, "redis_kill"), (13.0, "cache_kill"), (15.0, "idle"), (16.5, "redis_kill"),
             (18.0, "disk_fill"), (20.0, "idle"), (21.5, "redis_kill"), (23.0, "cache_freeze"), (25.0, "idle"),
             (26.5, "redis_kill"), (28.0, "corrupt")]
SHORT_PLAN = [(0.12, "redis_kill"), (0.27, "cache_freeze"), (0.42, "corrupt"), (0.5, "idle"), (0.6, "cache_kill"),
              (0.76, "disk_fill")]


@dataclass
class SoakConfig:
    """What a run is: its length, load, engine, tiers' sizes and fault plan."""

    minutes: float = 30.0
    clients: int = 8
    engine: str = "kvtier"  # or "vllm"
    calibrate: bool = True  # False: clients send back to back (no capacity measured; the test's setting)
    disk_budget: int = 256 << 20
    cache_server_bytes: str = "256MiB"
    kvtier_blocks: int = 512  # kvtier serve's KV blocks of 16 tokens: small, so the tiers are used
    documents: int = len(P.DOCUMENTS)  # the shared documents in use (fewer: more reuse in a short run)
    max_tokens: int = P.MAX_TOKENS  # greedy tokens per answer
    # (fraction of the soak, fault or "idle"); None: FULL_PLAN from 10 minutes on, else SHORT_PLAN
    plan: list[tuple[float, str]] | None = None
    # None: the load runs `minutes`. A count: it runs until that many requests were answered, the
    # plan ran and `clients` more were answered after its end; a plan's fractions are then of this
    # count (each fault starts once so many requests were answered and the one before it ended),
    # and `minutes` only bounds the run (one that reaches it records a `deadline_passed` event).
    requests: int | None = None
    seed: int = 0
    tiers_desc: list[str] = field(default_factory=list)

    def fault_plan(self) -> list[tuple[float, str]]:
        if self.plan is not None:
            return self.plan
        return [(at / 30.0, k) for at, k in FULL_PLAN] if self.minutes >= 10 else SHORT_PLAN


class Soak:
    """One run: the processes, the load, the faults, and what was recorded. `close()` stops
    every process it started."""

    def __init__(self, cfg: SoakConfig, work: Path) -> None:
        self.cfg, self.work = cfg, work
        self.model = str(ensure_default_model())
        self.redis = start_redis(["--maxmemory", "512mb", "--maxmemory-policy", "allkeys-lru"])
        # on a port of its own: a restart after a kill comes back where the tier looks for it
        self.cache = CacheServerProcess("--max-bytes", cfg.cache_server_bytes, port=free_port())
        self.disk = work / "disk"
        tiers = ["cpu?budget=32MiB", f"disk://{self.disk}?budget={cfg.disk_budget}", self.redis.url, self.cache.url]
        cfg.tiers_desc = ["cpu 32MiB", f"disk {cfg.disk_budget >> 20}MiB", "redis (maxmemory 512mb)",
                          f"cache-server {cfg.cache_server_bytes}"]
        self.server: Server | None = None
        try:
            self.server = start_server(cfg.engine, self.model, tiers, CHUNK_SIZE, work, cfg.kvtier_blocks)
        except BaseException:
            self.close()
            raise
        self.t0 = 0.0
        self.requests: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.health: list[tuple[float, float, int]] = []  # (t, latency, status)
        self.events: list[dict[str, Any]] = []  # faults, idle points, errors
        self.idle_points: list[dict[str, Any]] = []
        self.paused = asyncio.Event()
        self.paused.set()  # set: clients may send
        self.in_flight = 0
        self.answered = 0  # recorded requests that ended (answered or failed)
        self.load_done = asyncio.Event()  # set: the count-based load is over

    def now(self) -> float:
        return time.monotonic() - self.t0

    def event(self, kind: str, detail: str, **extra: Any) -> None:
        self.events.append({"t": round(self.now(), 2), "kind": kind, "detail": detail, **extra})
        print(f"[{self.now():7.1f}s] {kind}: {detail}", flush=True)

    # ---- load --------------------------------------------------------------------------
    def running(self, until: float) -> bool:
        """True until `until` (seconds on this run's clock) or the end of a count-based load."""
        return self.now() < until and not self.load_done.is_set()

    async def pause(self, seconds: float) -> None:
        """Sleeps `seconds`, or less if a count-based load ends meanwhile."""
        try:
            await asyncio.wait_for(self.load_done.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    async def client_loop(self, c: P.Client, api: openai.AsyncOpenAI, rate: float | None, until: float,
                          record: bool) -> int:
        """Sends requests until `until` (seconds on this run's clock) or the end of a count-based
        load: back to back (rate None) or at Poisson arrivals of `rate` per second; returns how
        many finished."""
        done = 0
        next_at = self.now()
        while self.running(until):
            if rate is not None:
                next_at += c.rng.expovariate(rate)
                await asyncio.sleep(max(0.0, next_at - self.now()))
                if self.now() >= until:
                    break
            await self.paused.wait()
            kind, body = c.next_request()
            start = self.now()
            self.in_flight += 1
            try:
                res = await P.stream_request(api, body, self.cfg.max_tokens)
                c.answered(kind, res["text"])
                done += 1
                if record:
                    self.requests.append({"t": round(start, 3), "kind": kind, "body": body, "ok": True,
                                          **{k: res[k] for k in ("ttft", "e2e", "text", "cached_tokens",
                                                                 "prompt_tokens")},
                                          "itl_max": max(res["gaps"], default=0.0), "gaps": res["gaps"]})
            except Exception as exc:  # a failed request is a finding, never the end of the run
                if kind == "chat":
                    c.chat = []
                self.event("request_failed", f"{kind}: {type(exc).__name__}: {exc}"[:300])
                if record:
                    self.requests.append({"t": round(start, 3), "kind": kind, "body": body, "ok": False,
                                          "error": f"{type(exc).__name__}: {exc}"[:300]})
            finally:
                self.in_flight -= 1
                if record:
                    self.answered += 1
        return done

    async def measure_capacity(self, seconds: float) -> float:
        """Returns requests/s of the mix with every client sending back to back for `seconds`."""
        clients = [P.Client(i, random.Random(1000 + i), self.cfg.documents) for i in range(self.cfg.clients)]
        async with self.api() as api:
            start = self.now()
            done = await asyncio.gather(*(self.client_loop(c, api, None, start + seconds, False) for c in clients))
        return sum(done) / (self.now() - start)

    def api(self) -> openai.AsyncOpenAI:
        assert self.server is not None
        return openai.AsyncOpenAI(base_url=self.server.url + "/v1", api_key="unused", max_retries=0, timeout=600,
                                  http_client=None)

    # ---- watchers ----------------------------------------------------------------------
    async def sample(self) -> None:
        """Records one sample: both RSS figures and the server's /metrics (soak_engines.figures)."""
        assert self.server is not None
        row: dict[str, Any] = {"t": round(self.now(), 2), "rss_server": self.server.rss(),
                               "rss_cache_server": P.rss_bytes(self.cache.proc.pid) if self.cache.proc else 0}
        try:
            m = await asyncio.to_thread(P.scrape, self.server.url)
            row["metrics"] = figures(self.cfg.engine, m)
        except Exception as exc:
            self.event("metrics_failed", f"{type(exc).__name__}: {exc}")
        self.samples.append(row)

    async def sample_loop(self, until: float) -> None:
        while self.running(until):
            await self.sample()
            await self.pause(SAMPLE_S)

    async def health_loop(self, until: float) -> None:
        assert self.server is not None
        async with httpx.AsyncClient(base_url=self.server.url, timeout=10) as client:
            while self.running(until):
                t = self.now()
                t1 = time.perf_counter()
                try:
                    status = (await client.get("/health")).status_code
                except httpx.HTTPError:
                    status = 0
                latency = time.perf_counter() - t1
                self.health.append((round(t, 2), latency, status))
                if status != 200 or latency > 1.0:
                    self.event("health_slow_or_failed", f"status {status} after {latency:.2f}s")
                await self.pause(1.0)

    # ---- faults and idle points --------------------------------------------------------
    async def fault(self, kind: str) -> None:
        start = self.now()
        if kind == "redis_kill":
            self.redis.kill()
            await asyncio.sleep(5.0)
            await asyncio.to_thread(self.redis.restart)
            detail = "redis-server SIGKILLed, restarted (empty) 5 s later"
        elif kind == "cache_freeze":
            detail = await asyncio.to_thread(P.freeze, self.cache, 5.0)
        elif kind == "cache_kill":
            self.cache.kill()
            await asyncio.sleep(2.0)
            await asyncio.to_thread(self.cache.start)
            detail = "cache server SIGKILLed, restarted (empty) 2 s later"
        elif kind == "corrupt":
            detail = await asyncio.to_thread(P.corrupt_in_place, self.redis.client(), self.disk, random.Random(7))
        else:
            detail = await asyncio.to_thread(P.fill_disk, self.disk, self.cfg.disk_budget)
        self.event("fault", detail, fault=kind, start=round(start, 2), end=round(self.now(), 2),
                   window=[round(start, 2), round(self.now() + RECOVERY_S, 2)])

    async def idle_point(self) -> None:
        """Holds the load until nothing runs and the stores landed, then reads what must be 0
        (the figures this engine exposes: soak_engines.unavailable names the others)."""
        assert self.server is not None
        self.paused.clear()
        try:
            deadline = self.now() + 120
            while self.in_flight and self.now() < deadline:
                await asyncio.sleep(0.1)
            m: dict[str, float] = {}
            while self.now() < deadline:
                m = figures(self.cfg.engine, await asyncio.to_thread(P.scrape, self.server.url))
                if not (m.get("kvtier:kv_pending_stores", 0) or m.get("kvtier:kv_slow_tier_writes_pending", 0)
                        or m.get("kvtier:kv_loads_in_flight", 0)):
                    break
                await asyncio.sleep(0.2)
            names = ("kvtier:kv_blocks_in_use", "kvtier:kv_block_refs", "kvtier:kv_load_holds",
                     "kvtier:kv_loads_in_flight", "kvtier:kv_pending_stores", "kvtier:kv_slow_tier_writes_pending",
                     "kvtier:num_requests_running", "kvtier:num_requests_waiting")
            missing = unavailable(self.cfg.engine)
            point = {"t": round(self.now(), 2),
                     **{n.split(":")[1]: m.get(n, -1.0) for n in names if n.split(":")[1] not in missing}}
            self.idle_points.append(point)
            self.event("idle_point", json.dumps({k: v for k, v in point.items() if k != "t"}))
        finally:
            self.paused.set()

    async def schedule(self, plan: list[tuple[float, str]], start: float, length: float) -> None:
        for at, kind in plan:
            await asyncio.sleep(max(0.0, start + at * length - self.now()))
            await (self.idle_point() if kind == "idle" else self.fault(kind))

    async def schedule_by_count(self, plan: list[tuple[float, str]], requests: int, until: float) -> None:
        """Runs `plan` with its fractions of `requests` answered requests, then ends the load
        once `requests` were answered and `clients` more since the plan's end; by `until`, the
        run's bound, whatever is left is left (recorded as a `deadline_passed` event)."""

        async def answered(n: float) -> bool:
            while self.answered < n and self.now() < until:
                await asyncio.sleep(0.05)
            return self.answered >= n

        for at, kind in plan:
            if not await answered(at * requests):
                break
            await (self.idle_point() if kind == "idle" else self.fault(kind))
        else:
            if await answered(max(requests, self.answered + self.cfg.clients)):
                self.load_done.set()
                return
        self.event("deadline_passed", f"{self.answered} of {requests} requests answered, the plan not done "
                                      f"or not followed by {self.cfg.clients} more, at the bound")

    # ---- the run -----------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        self.t0 = time.monotonic()
        cfg = self.cfg
        calib = min(120.0, max(30.0, cfg.minutes * 6.0)) if cfg.calibrate else 0.0
        capacity, rate = float("nan"), None  # uncalibrated: closed loop, back to back
        if cfg.calibrate:
            self.event("phase", f"measuring capacity for {calib:.0f} s")
            capacity = await self.measure_capacity(calib)
            rate = 0.8 * capacity / cfg.clients
            self.event("phase", f"capacity {capacity:.2f} req/s; offering {0.8 * capacity:.2f} req/s")
        length = cfg.minutes * 60.0
        start = self.now()
        until = start + length
        clients = [P.Client(i, random.Random(cfg.seed + i), cfg.documents) for i in range(cfg.clients)]
        schedule = (self.schedule(cfg.fault_plan(), start, length) if cfg.requests is None
                    else self.schedule_by_count(cfg.fault_plan(), cfg.requests, until))
        async with self.api() as api:
            await asyncio.gather(self.sample_loop(until), self.health_loop(until), schedule,
                                 *(self.client_loop(c, api, rate, until, True) for c in clients))
        if cfg.requests is not None:
            length = self.now() - start  # a count-based load's own length
        await self.idle_point()  # the end is an idle point too
        await self.sample()  # the run's totals
        return {"capacity_rps": capacity, "offered_rps": 0.8 * capacity, "soak_start_s": start, "soak_s": length,
                "calibration_s": calib}

    def close(self) -> None:
        server = self.server
        for stop in (lambda: server.stop() if server else None, self.cache.kill, self.redis.stop):
            try:
                stop()
            except Exception as exc:
                print(f"cleanup: {exc}", file=sys.stderr)


def check_answers(cfg: SoakConfig, model: str, requests: list[dict[str, Any]], work: Path,
                  tie_nats: float = 0.01) -> dict[str, Any]:
    """Replays every answered request (each distinct body once, REPLAY_CONCURRENCY at a time)
    on a server of the same engine without a connector (512 blocks); returns the counts ("same", "near_tie",
    "wrong", "distinct_prompts") and up to 50 requests whose answers differ."""
    from concurrent.futures import ThreadPoolExecutor

    answered = [r for r in requests if r["ok"]]
    bodies = {json.dumps(r["body"], sort_keys=True): r["body"] for r in answered}
    ref = start_server(cfg.engine, model, [], CHUNK_SIZE, work)
    try:
        with ThreadPoolExecutor(REPLAY_CONCURRENCY) as pool:
            refs = dict(zip(bodies, pool.map(lambda b: P.reference_answer(ref.url, b, cfg.max_tokens),
                                             bodies.values())))
    finally:
        ref.stop()
    verdicts = {"same": 0, "near_tie": 0, "wrong": 0}
    differing: list[dict[str, Any]] = []
    for r in answered:
        got = refs[json.dumps(r["body"], sort_keys=True)]
        verdict = P.divergence(r["text"], got, tie_nats)
        verdicts[verdict] += 1
        if verdict != "same":
            differing.append({"t": r["t"], "kind": r["kind"], "verdict": verdict, "answer": r["text"],
                              "reference": got["text"]})
    return {**verdicts, "distinct_prompts": len(bodies), "differing": differing[:50]}


def run_soak(cfg: SoakConfig, work: Path) -> dict[str, Any]:
    """Runs a soak in `work` (a scratch directory), checks every answer, and returns what the
    report reads (config, run, answers, events, idle points, samples, health, requests)."""
    soak = Soak(cfg, work)
    try:
        run = asyncio.run(soak.run())
    finally:
        soak.close()
    server_log = soak.server.log() if soak.server else ""
    print("checking every answer against a server without a connector ...", flush=True)
    answers = check_answers(cfg, soak.model, soak.requests, work)
    return {"config": {"engine": cfg.engine, "minutes": cfg.minutes, "clients": cfg.clients,
                       "chunk_size": CHUNK_SIZE if cfg.engine == "kvtier" else VLLM_CHUNK_SIZE,
                       "tiers": cfg.tiers_desc, "max_tokens": cfg.max_tokens,
                       "mix": {"chat": 0.4, "document": 0.4, "unique": 0.2},
                       "unavailable_figures": unavailable(cfg.engine)},
            "run": run, "answers": answers, "events": soak.events, "idle_points": soak.idle_points,
            "samples": soak.samples, "health": soak.health,
            "requests": [{k: v for k, v in r.items() if k not in ("body", "text")} for r in soak.requests],
            "server_log_tail": server_log[-4000:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="soak length after calibration (default: 30)")
    ap.add_argument("--name", default=None,
                    help="results file stem in benchmarks/results (default: soak, or soak_vllm with --engine vllm)")
    ap.add_argument("--engine", choices=["kvtier", "vllm"], default="kvtier",
                    help="the server soaked: kvtier serve, or vllm serve with kvtier's connector (default: kvtier)")
    args = ap.parse_args()
    if args.minutes <= 0:
        ap.error("--minutes must be > 0")
    name = args.name or ("soak" if args.engine == "kvtier" else "soak_vllm")
    with tempfile.TemporaryDirectory(prefix="kvtier-soak-") as tmp:
        out = run_soak(SoakConfig(minutes=args.minutes, engine=args.engine), Path(tmp))
    write_report(out, RESULTS / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
