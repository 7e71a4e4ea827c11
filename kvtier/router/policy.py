"""Routing policies: each ranks the candidate backends for one request, best first. The
proxy tries them in that order and never tries one twice.

- `round-robin`: the baseline; rotates through the candidates.
- `prefix-hash`: rendezvous hashing of the prompt's first chunk, so one conversation or one
  shared document keeps landing on the same backend (cheap affinity, no lookups), and
  removing a backend moves only the prompts that hashed to it.
- `kv-aware`: asks every candidate's `/kv/lookup` concurrently (short timeout) and ranks by
  the longest hit, then by a hit in the backend's own prefix cache over one in a tier (it is
  faster to use), then by load, then in prefix-hash order; a backend that does not answer in
  time counts as no hit. A backend whose load (running + waiting) exceeds the least loaded
  one's by more than `balance_threshold` ranks after the others, whatever it holds.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from kvtier.router import POLICIES
from kvtier.router.backends import Backend, BackendPool
from kvtier.router.prompt_view import PromptView
from kvtier.router.router_config import RouterConfig
from kvtier.router.router_metrics import RouterMetrics

logger = logging.getLogger("kvtier.router")


@dataclass
class Ranking:
    """Candidates best first, and the prefix each reported holding (kv-aware only)."""

    order: list[Backend]
    hit_tokens: dict[Backend, int] = field(default_factory=dict)


class Policy(Protocol):
    name: str

    async def rank(self, view: PromptView, candidates: list[Backend], headers: dict[str, str]) -> Ranking:
        """Returns `candidates` ordered best first; `headers` go with any backend call."""
        ...


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    async def rank(self, view: PromptView, candidates: list[Backend], headers: dict[str, str]) -> Ranking:
        if not candidates:
            return Ranking([])
        k = next(self._counter) % len(candidates)
        return Ranking(candidates[k:] + candidates[:k])


class PrefixHash:
    name = "prefix-hash"

    async def rank(self, view: PromptView, candidates: list[Backend], headers: dict[str, str]) -> Ranking:
        def weight(b: Backend) -> bytes:
            return hashlib.blake2b(view.prefix_key + b"\x00" + b.url.encode(), digest_size=8).digest()

        return Ranking(sorted(candidates, key=weight, reverse=True))


class KvAware:
    name = "kv-aware"

    def __init__(self, pool: BackendPool, metrics: RouterMetrics, timeout_s: float = RouterConfig.lookup_timeout,
                 balance_threshold: int = RouterConfig.balance_threshold) -> None:
        self.pool, self.metrics, self.timeout_s = pool, metrics, timeout_s
        self.balance_threshold = balance_threshold

    async def rank(self, view: PromptView, candidates: list[Backend], headers: dict[str, str]) -> Ranking:
        if view.lookup is None or len(candidates) < 2:
            return Ranking(sorted(candidates, key=lambda b: b.in_flight))
        start = time.perf_counter()
        answers = await asyncio.gather(*(self._lookup(b, view.lookup, headers) for b in candidates))
        self.metrics.lookup_seconds.observe(time.perf_counter() - start)

        affinity = {b: i for i, b in enumerate((await PrefixHash().rank(view, candidates, headers)).order)}

        loads = [max(b.in_flight, a.get("num_requests_running", 0) + a.get("num_requests_waiting", 0))
                 for b, a in zip(candidates, answers)]
        least = min(loads)

        def score(i: int) -> tuple[bool, int, int, int, int]:
            a, b = answers[i], candidates[i]
            # A backend past the balance threshold goes last whatever it holds: a popular
            # prefix must not pile every request onto one instance. Last, prefix-hash order:
            # equal new prompts spread over backends, and stay put.
            return (loads[i] - least > self.balance_threshold, -a.get("max_hit_tokens", 0),
                    -a.get("engine_prefix_cache_tokens", 0), loads[i], affinity[b])

        ranked = sorted(range(len(candidates)), key=score)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("kv-aware ranking: %s", "; ".join(
                f"{candidates[i]} hit={answers[i].get('max_hit_tokens', 0)} "
                f"own={answers[i].get('engine_prefix_cache_tokens', 0)} load={loads[i]}" for i in ranked))
        return Ranking([candidates[i] for i in ranked],
                       {b: int(answers[i].get("max_hit_tokens", 0)) for i, b in enumerate(candidates)})

    async def _lookup(self, backend: Backend, body: dict[str, object], headers: dict[str, str]) -> dict[str, int]:
        """Returns the backend's `/kv/lookup` answer's numbers, or {} (no hit) on any failure."""
        try:
            r = await self.pool.client.post(f"{backend.url}/kv/lookup", json=body, headers=headers,
                                            timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            self.metrics.backend_errors.labels(backend.url, "lookup").inc()
            if isinstance(exc, httpx.ConnectError):  # refused: down until its health check passes
                self.pool.mark_down(backend, "lookup connection refused")
            return {}
        if r.status_code != 200:  # e.g. a backend without /kv/lookup, or a prompt it rejects
            return {}
        data = r.json()
        return {k: v for k, v in data.items() if isinstance(v, int)} if isinstance(data, dict) else {}


def make_policy(name: str, pool: BackendPool, metrics: RouterMetrics, lookup_timeout_s: float,
                balance_threshold: int = RouterConfig.balance_threshold) -> Policy:
    """Returns the policy called `name` (one of POLICIES); raises ValueError otherwise."""
    if name == "round-robin":
        return RoundRobin()
    if name == "prefix-hash":
        return PrefixHash()
    if name == "kv-aware":
        return KvAware(pool, metrics, lookup_timeout_s, balance_threshold)
    raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {name!r}")
