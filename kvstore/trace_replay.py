"""Request traces (kvstore/traces.py) replayed through kvtier's tiers: the hit rate, prefill
saved and bytes written per tier that a trace would see with given tiers (`kvtier cache plan`,
`make bench-trace`).

Each block is stored as a tiny chunk; the replay is the tiers' own bookkeeping (budget, eviction
policy, admission, the storage manager's write-through or demotion, promotion of hits), not
their I/O. `replay_tier` stores every block at one size, so a budget counts blocks (what
`make bench-trace` compares policies and the offline optimum in); `replay_manager` (and `plan`)
stores a block at a size in proportion to its tokens, as a tier holds a prompt's short last
chunk, so a budget counts tokens as it does bytes of K/V.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache

import torch

from kvstore.backend import StorageBackend, leading_run
from kvstore.backends.memory import CPUBackend
from kvstore.capabilities import LOCAL_TIERS
from kvstore.storage_manager import StorageManager
from kvstore.store_config import TierSpec
from kvstore.traces import BLOCK_TOKENS, Request

PAYLOAD = torch.zeros(1, 2, 1, 1, 8, dtype=torch.float16)
"""The chunk every block is stored as: 32 bytes, so a budget counts blocks."""

PAYLOAD_BYTES = PAYLOAD.numel() * PAYLOAD.element_size()

TOKEN_BYTES = 2
"""Bytes per token of the chunks `replay_manager` stores (`sized_payload`)."""


@cache
def sized_payload(tokens: int) -> torch.Tensor:
    """Returns the chunk a block of `tokens` tokens is stored as by `replay_manager`:
    `TOKEN_BYTES` bytes per token, so a budget counts tokens."""
    return torch.zeros(1, 2, tokens, 1, 1, dtype=torch.uint8)


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


def trace_key(block: int) -> str:
    """Returns the chunk key a block is stored under (shaped as kvtier's chunk keys)."""
    return f"kvtier:trace:float16:v1:c{BLOCK_TOKENS}:{block:032x}"


def replay_tier(requests: Sequence[Request], tier: StorageBackend) -> Tally:
    """Replays `requests` through one tier: lookup (batched_contains), read the held run
    (batched_get: a hit is a use), store what it lacked (batched_put)."""
    tally = Tally()
    for r in requests:
        keys = [trace_key(b) for b in r.blocks]
        held = tier.batched_contains(keys)
        run = leading_run(held)
        if run:
            tier.batched_get(keys[:run], read_only=True)
        tally.add(r, run)
        missing = [(k, PAYLOAD) for k, h in zip(keys, held) if not h]
        if missing:
            tier.batched_put(missing)
    return tally


@dataclass
class ManagerReplay:
    """What a replay through a storage manager saw: the tally, and per tier (by name) the prompt
    tokens it served and the tokens of the blocks it stored."""

    tally: Tally
    hit_tokens: dict[str, int]
    tokens_stored: dict[str, int]


def replay_manager(requests: Sequence[Request], manager: StorageManager) -> ManagerReplay:
    """Replays `requests` through a storage manager as the connector uses it: where each block
    is (one query per tier), fetch of the held run, promotion of what came from a slower tier,
    store of what no tier held (each block at `sized_payload` of its tokens); waits for the
    background writer after each request, so the replay does not depend on its speed."""
    tally = Tally()
    served = dict.fromkeys(manager.names, 0)
    for r in requests:
        keys = [trace_key(b) for b in r.blocks]
        where = manager.batched_where(keys)
        got = manager.fetch(keys[:leading_run([w is not None for w in where])], read_only=True)
        run = leading_run([kv is not None for kv, _ in got])  # (a chunk may leave in between)
        tally.add(r, run)
        for i, (_, tier) in enumerate(got[:run]):
            served[manager.names[tier]] += r.block_tokens(i)
        manager.promote([(k, kv, t) for k, (kv, t) in zip(keys[:run], got[:run]) if kv is not None and t > 0],
                        owned=False)
        missing = [(k, sized_payload(r.block_tokens(i))) for i, (k, w) in enumerate(zip(keys, where)) if w is None]
        if missing:
            manager.batched_put(missing)
        manager.flush()
    stored = {name: s.bytes_stored // TOKEN_BYTES for name, s in manager.stats().items()}
    return ManagerReplay(tally, served, stored)


@dataclass
class TierPlan:
    """One tier's figures in a plan."""

    url: str
    capacity_blocks: int | None  # None: unbounded
    hit_tokens: int
    bytes_written: int


@dataclass
class Plan:
    """What a trace would see with given tiers (`plan`)."""

    requests: int
    prompt_tokens: int
    hit_tokens: int
    tiers: list[TierPlan] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(self.prompt_tokens, 1)


def plan(requests: Sequence[Request], specs: Sequence[TierSpec], kv_bytes_per_token: int) -> Plan:
    """Returns the hit rate, prefill saved and bytes written per tier that `requests` would see
    with the tiers `specs` (fastest first: each one's budget, eviction policy and fill), a block
    of a trace holding its tokens (`block_size`, fewer in a prompt's last block) of
    `kv_bytes_per_token` bytes each; a tier's `capacity_blocks` is the full blocks its budget
    holds. Every tier is modelled by what decides its contents, its budget and policy (the same
    code each kind evicts with); it raises ValueError naming a tier whose fill cannot work."""
    if kv_bytes_per_token <= 0:
        raise ValueError(f"kv bytes per token must be positive, got {kv_bytes_per_token}")
    block_size = requests[0].block_size if requests else BLOCK_TOKENS
    block_bytes = block_size * kv_bytes_per_token
    for i, spec in enumerate(specs):
        if spec.fill == "demote" and (i == 0 or specs[i - 1].scheme not in LOCAL_TIERS):
            above = "no tier is above it" if i == 0 else f"the tier above is {specs[i - 1].scheme}"
            raise ValueError(f"tier {spec.url}: fill=demote takes what a cpu or device tier above it evicts; {above}")
    capacities = [None if s.budget is None else s.budget // block_bytes for s in specs]
    tiers = [CPUBackend(byte_budget=None if s.budget is None else s.budget // kv_bytes_per_token * TOKEN_BYTES,
                        eviction=s.eviction) for s in specs]
    names = [f"{i}:{s.url}" for i, s in enumerate(specs)]
    with StorageManager(tiers, names=names, fills=[s.fill for s in specs], queue_size=1 << 16) as manager:
        seen = replay_manager(requests, manager)
    return Plan(len(requests), seen.tally.prompt_tokens, seen.tally.hit_tokens,
                [TierPlan(s.url, c, seen.hit_tokens[n], seen.tokens_stored[n] * kv_bytes_per_token)
                 for s, c, n in zip(specs, capacities, names)])
