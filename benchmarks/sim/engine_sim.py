"""One simulated engine: vLLM-style continuous batching with chunked prefill over a paged pool
with prefix caching, a kvtier connector that loads from tiers on a loader thread, and step
times from the measured fit."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

from benchmarks.sim.cache import BlockPool, ChunkTier
from benchmarks.sim.measured import StepFit
from benchmarks.sim.trace import Request


@dataclass(frozen=True)
class EngineConfig:
    """An engine's scheduler limits, as `kvtier serve` flags name them."""

    pool_blocks: int
    block_tokens: int = 16
    chunk_tokens: int = 256  # the connector's chunk size
    max_num_seqs: int = 64
    max_batched_tokens: int = 2048


@dataclass
class Live:
    """A request on an engine, from admission to its last token."""

    req: Request
    blocks: list[Hashable]
    prompt_keys: list[Hashable]
    engine_hit: int = 0
    loaded: int = 0
    computed: int = 0
    decoded: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    engine: int = -1
    step_tokens: int = 0  # prompt tokens in the current step


class SimEngine:
    """State and scheduling of one engine; the event loop calls `schedule` when it is idle and
    `finish_step` at the step's end."""

    def __init__(self, idx: int, cfg: EngineConfig, step: StepFit, local: list[ChunkTier],
                 shared: list[ChunkTier]) -> None:
        self.idx = idx
        self.cfg = cfg
        self.step = step
        self.tiers = [*local, *shared]  # fastest first, as the storage manager orders them
        self.local = local
        self.pool = BlockPool(cfg.pool_blocks)
        self.waiting: deque[Request] = deque()
        self.ready: deque[Live] = deque()  # loaded, not yet scheduled
        self.running: list[Live] = []
        self.num_loading = 0
        self.loader_free_s = 0.0
        self.busy = False

    def queue_len(self) -> int:
        """Returns running + waiting + loading requests (the router's tie-break)."""
        return len(self.running) + len(self.waiting) + len(self.ready) + self.num_loading

    def _tier_run(self, req: Request, start_token: int) -> int:
        """Returns where the run of chunks some tier holds, starting at the chunk holding
        `start_token`, ends (in tokens)."""
        c = self.cfg.chunk_tokens
        keys = req.block_keys(c)
        i = start_token // c
        for t in self.tiers:  # one batched existence query per tier
            t.lookups += 1
        while i < len(keys) and any(keys[i] in t for t in self.tiers):
            i += 1
        return i * c

    def lookup(self, req: Request) -> tuple[int, int]:
        """Returns (engine prefix-cache tokens, max hit tokens over the engine and its tiers),
        as `/kv/lookup` reports them."""
        own = self.pool.hit_blocks(req.block_keys(self.cfg.block_tokens)) * self.cfg.block_tokens
        return own, max(own, self._tier_run(req, own))

    def _admit(self, req: Request, now: float) -> tuple[Live | None, float | None]:
        """Takes blocks for `req`; returns its Live (None when the pool is full) and, when it
        must load from tiers first, the time the load ends."""
        b = self.cfg.block_tokens
        keys = req.block_keys(b)
        total = -(-(req.prompt_tokens + req.answer_tokens) // b)
        hit_blocks = self.pool.hit_blocks(keys)
        own = min(hit_blocks * b, req.prompt_tokens - 1)
        hit_blocks = own // b
        if total - hit_blocks > self.pool.num_available():  # cheap refusal while the pool is full
            return None, None
        blocks: list[Hashable] = [*keys[:hit_blocks], *(("p", req.rid, j) for j in range(hit_blocks, total))]
        if not self.pool.acquire(blocks):
            return None, None
        live = Live(req, blocks, keys, engine_hit=own, computed=own, engine=self.idx)
        end = min(self._tier_run(req, own), req.prompt_tokens - 1)
        if end <= own:
            return live, None
        live.loaded = end - own
        c = self.cfg.chunk_tokens
        ckeys = req.block_keys(c)
        secs = 0.0
        for i in range(own // c, end // c + (1 if end % c else 0)):
            tier = next(t for t in self.tiers if ckeys[i] in t)
            secs += tier.get(ckeys[i]) + tier.latency_s
            for t in self.local:  # the storage manager promotes a hit to the faster tiers
                if t is not tier and ckeys[i] not in t:
                    t.put(ckeys[i])
        live.computed = end
        start = max(now, self.loader_free_s)
        self.loader_free_s = start + secs
        return live, self.loader_free_s

    def schedule(self, now: float) -> tuple[float | None, list[tuple[float, Live]]]:
        """Builds the next step: decodes, continuing prefills, then new requests (FIFO, within
        max_num_seqs, the token budget and free blocks). Returns the step's seconds (None: idle)
        and the loads it started, as (end time, request)."""
        budget = self.cfg.max_batched_tokens
        prefill = decodes = 0
        attn = 0.0
        while self.ready:
            self.running.append(self.ready.popleft())
        for lv in self.running:
            if lv.first_token_s is not None:
                decodes += 1
                attn += lv.req.prompt_tokens + lv.decoded
                budget -= 1
        loads: list[tuple[float, Live]] = []
        for lv in self.running:
            if lv.first_token_s is None and budget > 0:
                n = min(lv.req.prompt_tokens - lv.computed, budget)
                lv.step_tokens, budget = n, budget - n
                prefill += n
                attn += n * (lv.computed + n / 2)
        while self.waiting and budget > 0 and len(self.running) + self.num_loading < self.cfg.max_num_seqs:
            live, load_end = self._admit(self.waiting[0], now)
            if live is None:
                break
            self.waiting.popleft()
            if load_end is not None:
                self.num_loading += 1
                loads.append((load_end, live))
                continue
            self.running.append(live)
            n = min(live.req.prompt_tokens - live.computed, budget)
            live.step_tokens, budget = n, budget - n
            prefill += n
            attn += n * (live.computed + n / 2)
        if not prefill and not decodes:
            return None, loads
        return self.step.step_s(prefill, decodes, attn), loads

    def load_done(self, live: Live) -> None:
        self.num_loading -= 1
        self.ready.append(live)

    def finish_step(self, now: float) -> list[Live]:
        """Applies the step's work; returns the requests that finished (first tokens are
        stamped on the way)."""
        done: list[Live] = []
        still: list[Live] = []
        for lv in self.running:
            if lv.first_token_s is None:
                lv.computed += lv.step_tokens
                lv.step_tokens = 0
                if lv.computed >= lv.req.prompt_tokens:
                    lv.first_token_s = now
                    lv.decoded = 1
                    self._store(lv)
            else:
                lv.decoded += 1
            if lv.decoded >= lv.req.answer_tokens:
                lv.finish_s = now
                self.pool.release(lv.blocks)
                done.append(lv)
            else:
                still.append(lv)
        self.running = still
        return done

    def _store(self, lv: Live) -> None:
        """Names the prompt's computed blocks in the pool and stores its full chunks to every tier."""
        n = len(lv.prompt_keys)
        hit = lv.engine_hit // self.cfg.block_tokens
        lv.blocks[hit:n] = self.pool.commit(lv.blocks[hit:n], lv.prompt_keys[hit:n])
        for key in lv.req.block_keys(self.cfg.chunk_tokens):
            for t in self.tiers:
                t.put(key)
