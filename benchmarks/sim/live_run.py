"""The real side of the validation: two `kvtier serve` processes (one torch thread each)
sharing a `kvtier cache-server`, behind `kvtier router`, replaying a simulator trace over
HTTP as completions of token ids."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.sim.trace import Request
from harness.cache_server import CacheServerProcess
from harness.serve import RouterProcess, ServeProcess

VOCAB = (1000, 40000)  # plain token ids of the default model: no special tokens


@dataclass(frozen=True)
class Fleet:
    """Flags of the real run (the simulator gets the same numbers)."""

    pool_blocks: int
    max_num_seqs: int
    cache_bytes: int
    threads: int = 1


class Prompts:
    """Token ids for trace requests: a document's ids are shared by its users; a user's own
    ids (questions and stand-in answers) grow round by round, so each round's prompt is a
    prefix of the next, as the simulator assumes."""

    def __init__(self, seed: int, doc_tokens: int, user_tokens: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.doc_tokens, self.user_tokens = doc_tokens, user_tokens
        self._docs: dict[int, list[int]] = {}
        self._users: dict[int, list[int]] = {}

    def _ids(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.integers(*VOCAB, size=n)]

    def of(self, q: Request) -> list[int]:
        """Returns the prompt's token ids."""
        doc = self._docs.setdefault(q.doc, self._ids(self.doc_tokens))
        own = self._users.setdefault(q.user, self._ids(self.user_tokens))
        return doc[: q.doc_tokens] + own[: q.user_tokens]


async def complete(client: httpx.AsyncClient, url: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """Streams one completion; returns its TTFT (to the first chunk with a choice) and usage."""
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and ttft is None:
                ttft = time.perf_counter() - t0
    return {"ttft_s": ttft, "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)}


async def replay(url: str, trace: list[Request], prompts: Prompts) -> list[dict[str, Any]]:
    """Sends every request at its trace arrival time (open loop); returns one row per request."""
    rows: list[dict[str, Any]] = [{} for _ in trace]
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter() - trace[0].arrival_s

        async def one(q: Request) -> None:
            await asyncio.sleep(max(0.0, t0 + q.arrival_s - time.perf_counter()))
            rows[q.rid] = {"rid": q.rid, "user": q.user, "round": q.round,
                           **await complete(client, url, prompts.of(q), q.answer_tokens)}

        await asyncio.gather(*(one(q) for q in trace))
    return rows


def scrape(url: str) -> dict[str, float]:
    """Returns the serve process's kvtier counters (token totals) by metric name."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("kvtier:") and s.name.endswith("_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


Started = TypeVar("Started", CacheServerProcess, ServeProcess, RouterProcess)


class LiveFleet:
    """A cache server, two serve processes and a router, started fresh (empty caches)."""

    def __init__(self, fleet: Fleet, policy: str, model: str) -> None:
        self.procs: list[CacheServerProcess | ServeProcess | RouterProcess] = []
        try:
            cache = self._started(CacheServerProcess("--max-bytes", str(fleet.cache_bytes)))
            env = {"OMP_NUM_THREADS": str(fleet.threads), "MKL_NUM_THREADS": str(fleet.threads)}
            self.backends = [self._started(ServeProcess("--model", model, "--device", "cpu", "--num-gpu-blocks",
                                                        str(fleet.pool_blocks), "--max-num-seqs",
                                                        str(fleet.max_num_seqs), "--kv-tier", cache.url,
                                                        env=env)).url for _ in range(2)]
            args = [x for b in self.backends for x in ("--backend", b)]
            self.router = self._started(RouterProcess(*args, "--policy", policy)).url
        except BaseException:
            self.stop()
            raise

    def _started(self, proc: Started) -> Started:
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for p in reversed(self.procs):
            try:
                p.stop()
            except subprocess.TimeoutExpired:
                pass  # killed past its bound: nothing is left running
