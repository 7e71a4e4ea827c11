"""`BlendConnector`: CacheBlend on top of the prefix connector (same tiers, same storage manager).

A request whose prompt carries segments (`seq.segment_lens`: system, documents, ..., query)
is blended; any other request takes the plain prefix path of `KVTierConnector`.

- Lookup (scheduler): the context, every segment but the query (and never the last token), is
  reported as loadable from where the engine's own prefix cache stops. A segment missing from
  every tier is computed at load time, so the answer never over-promises.
- Load (worker, `start_load_kv`): each segment's stored K/V (positions 0..n-1, keyed from the
  segment root of `BlendConfig.segment_kv`, see `segments`) is fetched, its keys re-rotated to
  the segment's offset in this prompt and scattered into the request's fresh blocks (only
  positions after the engine's hit: those blocks are exact and never rewritten); then
  `blend_recompute` restores cross-segment attention for `ratio` of the tokens. A missing
  segment is recomputed there through every layer, inside this prompt, and stored from it
  (`in_context`, the default), or computed on its own first (`standalone`); either way its
  chunks go through the background store queue prefix stores use (a later fetch waits for
  them: read-your-writes). The engine then
  prefills the query suffix over the blended cache.
- Blended K/V is approximate: the request's `max_cacheable_tokens` stops the engine's prefix
  cache at the exact part (the engine's hit; the first segment: at position 0 its stored K/V
  is its standalone K/V, which is exact; and, in context, the segments after it that no tier
  held at admission, computed in this prompt over exact K/V: a cold prompt is cached whole),
  and blended requests are never stored as prefix chunks.
- Metrics: only segments fetched from a tier count as loaded (`connector_hit_tokens`, bytes,
  load time: fetch, re-rotation, scatter) and as the request's `num_cached_tokens` (with the
  engine's hit); computed segments and the recompute do not. Segment stores count as stored.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from connector.blend.config import BlendConfig
from connector.blend.executor import blend_recompute, compute_segment_kv, rerotate_kv
from connector.blend.segments import Segment, Span, context_segments, segment_spans
from connector.config import ConnectorConfig, make_config
from connector.gather import gather_chunk, scatter_chunk, slots_for
from connector.kvtier_connector import ConnectorMeta, KVTierConnector
from engine.models.llama import LlamaForCausalLM
from kvstore.storage_manager import StorageManager

if TYPE_CHECKING:
    from engine.attention_metadata import AttentionMetadata
    from engine.scheduler import SchedulerOutput
    from engine.sequence import Sequence


@dataclass
class _BlendJob:
    """Blend positions [start, end) of a request (start = the engine's prefix-cache hit).
    Positions [0, exact_end) come out exact: the engine's hit, the first segment, and the
    segments after it that no tier held at admission, computed in this prompt whatever the
    tiers hold by load time."""

    request_id: str
    start: int
    end: int
    segments: list[Segment]
    exact_end: int = 0
    token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # The request, so the blend can report how many of its tokens were loaded rather than
    # computed (`num_cached_tokens`): known only once its segments are fetched.
    seq: Sequence | None = None


@dataclass
class BlendMeta(ConnectorMeta):
    """One step's worker-side instructions: the prefix connector's (its stores) plus the blends."""

    blends: list[_BlendJob] = field(default_factory=list)


@dataclass
class BlendStats:
    """Totals since start-up (tokens and segments)."""

    requests: int = 0
    segment_hits: int = 0  # segments found in a tier
    segment_misses: int = 0  # segments computed (in context or standalone, per segment_kv) and stored
    blended_tokens: int = 0  # positions filled from segment K/V
    recomputed_tokens: int = 0  # of those, recomputed through every layer
    blend_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class BlendConnector(KVTierConnector):
    """A `KVTierConnector` that also blends segmented prompts (CacheBlend).

    Guarantees: a blend writes only blocks the request owns past the engine's prefix-cache hit;
    approximate K/V never enters the engine's prefix cache nor the prefix tiers; a segment that
    is missing, evicted or corrupt is computed, never an error; pins are released per fetch.
    """

    def __init__(self, config: ConnectorConfig | None = None, storage: StorageManager | None = None,
                 blend: BlendConfig | None = None) -> None:
        super().__init__(config, storage)
        self.blend = dataclasses.replace(blend or self.config.blend, enabled=True).validate()
        self.segment_separator = self.blend.separator
        self.model: LlamaForCausalLM | None = None
        self.stats = BlendStats()
        self._blend_plans: dict[str, _BlendJob] = {}  # looked up, not yet admitted
        self._to_blend: dict[str, _BlendJob] = {}  # admitted, blended in this step
        self._blended: set[str] = set()  # live requests holding blended K/V
        self._blend_meta: BlendMeta | None = None

    def register_model(self, model_config: Any) -> None:
        if getattr(model_config, "sliding_window_layers", ()):
            # blend_recompute attends over the whole context; a windowed layer would differ.
            raise ValueError(f"CacheBlend does not support sliding-window attention "
                             f"({model_config.model_type}, window {model_config.sliding_window})")
        super().register_model(model_config)
        self.blend.validate(model_config.num_layers)

    def register_model_module(self, model: torch.nn.Module) -> None:
        if not isinstance(model, LlamaForCausalLM):  # the executor runs its layers one by one
            raise TypeError(f"CacheBlend needs the engine's Llama-family model, got {type(model).__name__}")
        self.model = model

    # ---- scheduler side --------------------------------------------------------------
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        """Returns, for a segmented prompt, the context tokens after the engine's hit (all of
        them: missing segments are computed at load) to blend in the step (not async);
        otherwise the prefix connector's answer."""
        lens = seq.segment_lens
        if not lens or len(lens) < 2:
            return super().get_num_new_matched_tokens(seq, num_computed_tokens)
        rid = seq.request_id
        self._blend_plans.pop(rid, None)
        end = min(sum(lens[:-1]), seq.num_tokens - 1)
        if end <= num_computed_tokens:
            return 0, False
        self._blend_plans[rid] = _BlendJob(rid, num_computed_tokens, end, context_segments(lens))
        m = self.metrics.live(rid)
        m.num_prompt_tokens, m.engine_hit_tokens = seq.num_prompt_tokens, num_computed_tokens
        return end - num_computed_tokens, False

    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_external_tokens: int) -> None:
        job = self._blend_plans.pop(seq.request_id, None)
        if job is None:
            super().update_state_after_alloc(seq, block_ids, num_external_tokens)
            return
        if num_external_tokens <= 0:
            return
        job.end = min(job.end, job.start + num_external_tokens)
        job.seq = seq
        self._to_blend[seq.request_id] = job
        self._blended.add(seq.request_id)
        job.exact_end = min(self._exact_end(seq, job), job.end)
        # Only the exact part may be shared through the engine's prefix cache.
        seq.max_cacheable_tokens = max(job.start, job.exact_end // self.block_size * self.block_size)

    def _exact_end(self, seq: Sequence, job: _BlendJob) -> int:
        """Returns where the exact part of a blend ends: past the engine's hit, the first
        segment (standalone at position 0 it is what a full prefill computes) and, in context,
        every following segment up to the first that a tier holds (one existence query)."""
        exact = job.start
        todo = [g for g in job.segments if g.end > exact]
        if todo and todo[0].index == 0:
            exact = todo.pop(0).end
        if self.blend.segment_kv != "in_context" or not todo:
            return exact
        spans = [self._segment_spans(seq.token_ids_slice(g.start, g.end), "in_context") for g in todo]
        held = iter(self._held([k for sp in spans for _, _, k in sp]))
        for g, sp in zip(todo, spans):
            if all([next(held) for _ in sp]):  # a tier holds it: blended from here on
                break
            exact = g.end
        return exact

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> BlendMeta:
        """Returns the prefix connector's meta for plain requests (blended ones are never
        stored as prefix chunks) plus this step's blends."""
        plain = [r for r in scheduler_output.requests if r.request_id not in self._blended]
        prefix = super().build_connector_meta(dataclasses.replace(scheduler_output, requests=plain))
        meta = BlendMeta(saves=prefix.saves)
        for r in scheduler_output.requests:
            job = self._to_blend.pop(r.request_id, None)
            if job is not None:
                job.token_ids = r.seq.token_ids_slice(0, job.end)
                job.block_ids = list(r.block_ids)
                meta.blends.append(job)
        self._to_blend.clear()
        return meta

    def request_finished(self, seq: Sequence, block_ids: list[int]) -> bool:
        rid = seq.request_id
        self._blend_plans.pop(rid, None)
        self._to_blend.pop(rid, None)
        if rid in self._blended:
            self._blended.discard(rid)  # nothing of it is stored: its K/V is approximate
            self.metrics.finish(rid)
            return False
        return super().request_finished(seq, block_ids)

    # ---- worker side -----------------------------------------------------------------
    def bind_connector_metadata(self, metadata: Any) -> None:
        self._blend_meta = metadata if isinstance(metadata, BlendMeta) else None
        super().bind_connector_metadata(metadata)

    def clear_connector_metadata(self) -> None:
        self._blend_meta = None
        super().clear_connector_metadata()

    def start_load_kv(self, attn_metadata: AttentionMetadata) -> None:
        """Does the prefix loads, then each blend (fetch, re-rotate, scatter, recompute)."""
        super().start_load_kv(attn_metadata)
        if self._blend_meta is not None:
            for job in self._blend_meta.blends:
                self._run_blend(job)

    def _run_blend(self, job: _BlendJob) -> None:
        """Fills positions [job.start, job.end): segments a tier holds are loaded (fetched,
        re-rotated, scattered), the others computed; then the selective recompute. Only
        loaded segments count as loaded tokens and load time, and as the request's cached
        tokens; computing and recomputing are not loading."""
        if self.model is None:
            raise RuntimeError("BlendConnector needs the model module (register_model_module)")
        t0 = time.perf_counter()
        dev = self.kv_caches[0].device
        inv_freq = self.model.model.rotary.inv_freq
        b = self.blend
        missing = torch.zeros(job.end - job.start, dtype=torch.bool, device=dev)
        loaded: list[tuple[torch.Tensor, torch.Tensor]] = []  # (slots, K/V) fetched from a tier
        computed: list[tuple[torch.Tensor, torch.Tensor]] = []  # standalone, computed here
        to_store = []
        load_s = 0.0
        by_tier: dict[str, int] = {}
        for seg in job.segments:
            lo, hi = max(seg.start, job.start), min(seg.end, job.end)
            if lo >= hi:
                continue
            tokens = job.token_ids[seg.start:seg.end]
            # At position 0 a segment's K/V is its standalone K/V, exact, whichever way computed.
            mode = "standalone" if seg.start == 0 else b.segment_kv
            spans = self._segment_spans(tokens, mode)
            t_fetch = time.perf_counter()
            if seg.start > 0 and seg.end <= job.exact_end:  # promised exact: computed here
                kv, ok, tiers = None, [False] * len(spans), [-1] * len(spans)
            else:
                kv, ok, tiers = self._fetch_segment(spans)
            slots = slots_for(job.block_ids, self.block_size, lo, hi, device=dev)
            if kv is not None:
                self.stats.segment_hits += 1
                for (cs, ce, _), tier in zip(spans, tiers):  # the tokens of [lo, hi) each chunk gave
                    n = min(seg.start + ce, hi) - max(seg.start + cs, lo)
                    if n > 0:
                        name = self.storage.names[tier]
                        by_tier[name] = by_tier.get(name, 0) + n
                loaded.append((slots, rerotate_kv(kv[:, :, lo - seg.start: hi - seg.start].to(dev), seg.start,
                                                  inv_freq)))
                load_s += time.perf_counter() - t_fetch
                continue
            self.stats.segment_misses += 1
            if b.segment_kv == "in_context":  # recomputed below, inside this prompt
                missing[lo - job.start:hi - job.start] = True
                to_store.append((seg, [sp for sp, good in zip(spans, ok) if not good and seg.start + sp[1] <= hi]))
                continue
            kv = compute_segment_kv(self.model, tokens).to(self.kv_caches[0].dtype)
            self._store_segment(job.request_id, [(k, kv[:, :, s:e].contiguous())
                                                 for (s, e, k), good in zip(spans, ok) if not good])
            computed.append((slots, rerotate_kv(kv[:, :, lo - seg.start: hi - seg.start], seg.start, inv_freq)))
        if loaded:
            t_scatter = time.perf_counter()
            self._scatter(loaded)
            load_s += time.perf_counter() - t_scatter
        self._scatter(computed)
        recomputed = blend_recompute(self.model, self.kv_caches, job.block_ids, self.block_size,
                                     job.token_ids[job.start:job.end], job.start, job.end,
                                     b.ratio, b.check_layer, b.narrowing, missing=missing)
        for seg, spans in to_store:
            # Every layer of it was just computed in this prompt: store it at positions 0..
            kv = gather_chunk(self.kv_caches, slots_for(job.block_ids, self.block_size, seg.start, seg.end, device=dev))
            kv = rerotate_kv(kv, -seg.start, inv_freq)
            self._store_segment(job.request_id, [(k, kv[:, :, s:e].contiguous()) for s, e, k in spans])
        s = self.stats
        s.requests += 1
        s.blended_tokens += job.end - job.start
        s.recomputed_tokens += recomputed
        s.blend_seconds += time.perf_counter() - t0
        num_loaded = sum(slots.numel() for slots, _ in loaded)
        self.metrics.add(job.request_id, by_tier, connector_hit_tokens=num_loaded, load_seconds=load_s,
                         bytes_loaded=sum(kv.numel() * kv.element_size() for _, kv in loaded))
        if job.seq is not None:
            # The scheduler counted the whole blend as cached at admission; only the engine's
            # hit and the loaded segments were (what vLLM's num_cached_tokens means).
            job.seq.num_cached_tokens = job.start + num_loaded

    def _scatter(self, pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Writes (slots, K/V) pieces into the paged cache in one scatter."""
        if pieces:
            slots, kvs = zip(*pieces)
            scatter_chunk(self.kv_caches, torch.cat(slots), torch.cat(kvs, dim=2))

    def _store_segment(self, request_id: str, items: list[tuple[str, torch.Tensor]]) -> None:
        """Queues a segment's chunks (fresh tensors) on the background store queue that prefix
        stores use; once put they count as the request's stored tokens; a refused store is
        counted, never waited for."""
        nbytes = sum(kv.numel() * kv.element_size() for _, kv in items)
        ntokens = sum(kv.shape[2] for _, kv in items)
        done = functools.partial(self.metrics.add, request_id, stored_tokens=ntokens, bytes_stored=nbytes)
        dropped = functools.partial(self.metrics.add, request_id, dropped_store_bytes=nbytes)
        if items and not self._queue().submit(items, done, dropped):
            dropped()

    def stored_segment(self, token_ids: list[int], segment_kv: str | None = None) -> torch.Tensor | None:
        """Returns the stored K/V `(L, 2, n, H, D)` of a segment of `token_ids` at positions 0..
        of kind `segment_kv` (default: the config's), or None unless all of it is stored and
        well-formed. Read only (it may be a tier's own tensor)."""
        return self._fetch_segment(self._segment_spans(token_ids, segment_kv or self.blend.segment_kv))[0]

    def _segment_spans(self, token_ids: list[int], segment_kv: str) -> list[Span]:
        """Returns the chunk spans of a segment's K/V of kind `segment_kv` for this model."""
        return segment_spans(token_ids, self.chunk_size, self.model_config.fingerprint, self._kv_dtype, segment_kv)

    def _fetch_segment(self, spans: list[Span]) -> tuple[torch.Tensor | None, list[bool], list[int]]:
        """Returns a segment's stored K/V `(L, 2, n, H, D)` (None unless every chunk is there
        and well-formed), which chunks were, and the index of the tier each came from (-1:
        none). Read only: it may be a tier's own tensor (callers re-rotate a copy of it). Hits
        from slower tiers are promoted, as `StorageManager.batched_get` does."""
        keys = [k for _, _, k in spans]
        self._queue().wait_for(keys)  # read-your-writes: a segment store may still be queued
        found = self.storage.fetch(keys, read_only=True)
        self.storage.promote([(k, kv, t) for k, (kv, t) in zip(keys, found) if kv is not None and t > 0])
        ok = [self._chunk_ok(kv, e - s) for (s, e, _), (kv, _) in zip(spans, found)]
        tiers = [t for _, t in found]
        if not all(ok):
            return None, ok, tiers
        chunks = [kv for kv, _ in found if kv is not None]  # all ok: every one is there
        return (chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=2)), ok, tiers

    def blend_stats(self) -> dict[str, Any]:
        """Returns the blend totals since start-up (see `BlendStats`)."""
        return self.stats.to_dict()


def build_blend_connector(config_or_urls: Any = None, *, storage: StorageManager | None = None,
                          blend: BlendConfig | None = None, **overrides: Any) -> BlendConnector:
    """Returns a BlendConnector from anything `make_config` accepts (tier URLs, YAML, ...);
    `blend` overrides the config's `blend` section; `overrides` are `make_config` keywords."""
    return BlendConnector(make_config(config_or_urls, **overrides), storage=storage, blend=blend)
