"""CacheBlend's worker side: runs the blends a step's metadata names (docs/architecture.md,
"CacheBlend"; the scheduler side is connector/blend/blend_planner.py), the worker's extension
(connector/extension.py) when `blend.enabled`.

For each blend: every context segment's stored K/V (positions 0..n-1, keyed from the segment
root of `BlendConfig.segment_kv`, kvkeys/keyspace.py) is fetched, its keys re-rotated to
the segment's offset in this prompt and scattered into the request's fresh blocks (only
positions after the engine's hit: those blocks are exact and never rewritten); then
`blend_recompute` restores cross-segment attention for `ratio` of the tokens. A missing
segment is recomputed there through every layer, inside this prompt, and stored from it
(`in_context`, the default), or computed on its own first (`standalone`); either way its
chunks go through the store queue prefix stores use (a later fetch waits for them:
read-your-writes). Hits from slower tiers are promoted through the same queue.

Figures: only segments fetched from a tier count as loaded (`connector_hit_tokens`, bytes,
load time: fetch, re-rotation, scatter) and as the request's cached tokens (with the
engine's hit); computed segments and the recompute do not. Segment stores count as stored.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from connector.blend.blend_config import BlendConfig, engine_model
from connector.blend.executor import blend_recompute, check_blendable, compute_segment_kv, layer_inv_freqs, rerotate_kv
from connector.blend.segments import BlendSpec
from connector.connector_metrics import ConnectorMetrics
from connector.extension import WorkerExtension
from connector.loader import chunk_ok
from connector.store_queue import StoreQueue
from engine.kv_cache import KeyedModel, PagedKVLayout
from engine.models.base import CausalLM
from kvkeys.keyspace import Keyspace, Span
from kvstore.storage_manager import StorageManager

if TYPE_CHECKING:
    from engine.model_config import ModelConfig


def new_blender(config: BlendConfig, storage: StorageManager, stores: StoreQueue, layout: PagedKVLayout,
                keyspace: Keyspace, metrics: ConnectorMetrics, model_config: KeyedModel,
                model: torch.nn.Module | None) -> Blender:
    """Returns the worker side's CacheBlend over the engine's paged caches, blending with
    `model` (ValueError/TypeError if it cannot run it)."""
    blender = Blender(config, storage, stores, layout, keyspace, metrics)
    blender.register_model(engine_model(model_config), model)
    return blender


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


class Blender(WorkerExtension):
    """Runs blends on the engine's thread, inside the step that admitted them.

    Guarantees: a blend writes only blocks the request owns past the engine's prefix-cache
    hit; a segment that is missing, evicted or corrupt is computed, never an error; fetched
    values are read only (re-rotation works on a copy)."""

    def __init__(self, config: BlendConfig, storage: StorageManager, stores: StoreQueue, layout: PagedKVLayout,
                 keyspace: Keyspace, metrics: ConnectorMetrics) -> None:
        self.config = config
        self.storage = storage
        self.stores = stores
        self.layout = layout
        self.keyspace = keyspace
        self.metrics = metrics
        self.stats = BlendStats()
        self.model: CausalLM | None = None

    def register_model(self, model_config: ModelConfig, model: torch.nn.Module | None) -> None:
        """Checks the model CacheBlend runs layer by layer; raises ValueError/TypeError if it cannot."""
        self.config.validate(model_config.num_layers)
        self.model = check_blendable(model)  # the executor runs its layers one by one

    def run(self, work: list[BlendSpec]) -> dict[str, int]:
        """Runs the step's blends; returns each blended request's cached tokens (`blend`)."""
        return {spec.request_id: self.blend(spec) for spec in work}

    def blend(self, spec: BlendSpec) -> int:
        """Fills positions [spec.start, spec.end): segments a tier holds are loaded (fetched,
        re-rotated, scattered), the others computed; then the selective recompute. Returns
        the request's cached tokens: the engine's hit and the loaded segments."""
        if self.model is None:
            raise RuntimeError("CacheBlend needs the model module (register_model_module)")
        t0 = time.perf_counter()
        layout = self.layout
        dev = layout.device
        inv_freq = layer_inv_freqs(self.model)
        b = self.config
        missing = torch.zeros(spec.end - spec.start, dtype=torch.bool, device=dev)
        loaded: list[tuple[torch.Tensor, torch.Tensor]] = []  # (slots, K/V) fetched from a tier
        computed: list[tuple[torch.Tensor, torch.Tensor]] = []  # standalone, computed here
        to_store: list[tuple[int, int, list[Span]]] = []  # (segment start, end, spans) computed in context
        load_s = 0.0
        by_tier: dict[str, int] = {}
        for seg in spec.segments:
            lo, hi = max(seg.start, spec.start), min(seg.end, spec.end)
            if lo >= hi:
                continue
            tokens = spec.token_ids[seg.start:seg.end]
            # At position 0 a segment's K/V is its standalone K/V, exact, whichever way computed.
            mode = "standalone" if seg.start == 0 else b.segment_kv
            spans = self.keyspace.for_salt(spec.cache_salt).segment_spans(tokens, mode)
            t_fetch = time.perf_counter()
            if seg.start > 0 and seg.end <= spec.exact_end:  # promised exact: computed here
                kv, ok, tiers = None, [False] * len(spans), [-1] * len(spans)
            else:
                kv, ok, tiers = self.fetch_segment(spans)
            slots = layout.slots(spec.block_ids, lo, hi).to(dev)
            if kv is not None:
                self.stats.segment_hits += 1
                for sp, tier in zip(spans, tiers):  # the tokens of [lo, hi) each chunk gave
                    n = min(seg.start + sp.end, hi) - max(seg.start + sp.start, lo)
                    if n > 0:
                        name = self.storage.names[tier]
                        by_tier[name] = by_tier.get(name, 0) + n
                loaded.append((slots, rerotate_kv(kv[:, :, lo - seg.start: hi - seg.start].to(dev), seg.start,
                                                  inv_freq)))
                load_s += time.perf_counter() - t_fetch
                continue
            self.stats.segment_misses += 1
            missed = [sp for sp, good in zip(spans, ok) if not good]
            if b.segment_kv == "in_context":  # recomputed below, inside this prompt
                missing[lo - spec.start:hi - spec.start] = True
                to_store.append((seg.start, seg.end, [sp for sp in missed if seg.start + sp.end <= hi]))
                continue
            kv = compute_segment_kv(self.model, tokens).to(layout.dtype)
            self._store_segment(spec.request_id, [(sp.key, kv[:, :, sp.start:sp.end].contiguous()) for sp in missed])
            computed.append((slots, rerotate_kv(kv[:, :, lo - seg.start: hi - seg.start], seg.start, inv_freq)))
        if loaded:
            t_scatter = time.perf_counter()
            self._scatter(loaded)
            load_s += time.perf_counter() - t_scatter
        self._scatter(computed)
        recomputed = blend_recompute(self.model, layout.kv_caches, spec.block_ids, layout.block_size,
                                     spec.token_ids[spec.start:spec.end], spec.start, spec.end,
                                     b.ratio, b.check_layer, b.narrowing, missing=missing)
        for start, end, spans in to_store:
            # Every layer of it was just computed in this prompt: store it at positions 0..
            kv = layout.gather_chunk(layout.slots(spec.block_ids, start, end))
            kv = rerotate_kv(kv, -start, inv_freq)
            self._store_segment(spec.request_id, [(sp.key, kv[:, :, sp.start:sp.end].contiguous()) for sp in spans])
        s = self.stats
        s.requests += 1
        s.blended_tokens += spec.end - spec.start
        s.recomputed_tokens += recomputed
        s.blend_seconds += time.perf_counter() - t0
        num_loaded = sum(slots.numel() for slots, _ in loaded)
        self.metrics.add(spec.request_id, by_tier, connector_hit_tokens=num_loaded, load_seconds=load_s,
                         bytes_loaded=sum(kv.numel() * kv.element_size() for _, kv in loaded))
        return spec.start + num_loaded

    def _scatter(self, pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Writes (slots, K/V) pieces into the paged cache in one scatter."""
        if pieces:
            slots, kvs = zip(*pieces)
            self.layout.scatter_chunk(torch.cat(slots), torch.cat(kvs, dim=2))

    def _store_segment(self, request_id: str, items: list[tuple[str, torch.Tensor]]) -> None:
        """Queues a segment's chunks (fresh tensors) on the store queue; once put they count
        as the request's stored tokens; a refused store is counted, never waited for."""
        nbytes = sum(kv.numel() * kv.element_size() for _, kv in items)
        ntokens = sum(kv.shape[2] for _, kv in items)
        done = functools.partial(self.metrics.add, request_id, stored_tokens=ntokens, bytes_stored=nbytes)
        dropped = functools.partial(self.metrics.add, request_id, dropped_store_bytes=nbytes)
        if items and not self.stores.submit(items, done, dropped):
            dropped()

    def fetch_segment(self, spans: list[Span]) -> tuple[torch.Tensor | None, list[bool], list[int]]:
        """Returns a segment's stored K/V `(L, 2, n, H, D)` (None unless every chunk is there
        and well-formed), which chunks were, and the index of the tier each came from (-1:
        none). Read only: it may be a tier's own tensor. Hits from slower tiers are queued for
        promotion."""
        keys = [sp.key for sp in spans]
        self.stores.wait_for(keys)  # read-your-writes: a segment store may still be queued
        found = self.storage.fetch(keys, read_only=True)
        self.stores.promote([(k, kv, t) for k, (kv, t) in zip(keys, found) if kv is not None and t > 0])
        layout = self.layout
        ok = [chunk_ok(kv, (layout.num_layers, 2, sp.num_tokens, layout.num_kv_heads, layout.head_size), layout.dtype)
              for sp, (kv, _) in zip(spans, found)]
        tiers = [t for _, t in found]
        if not all(ok):
            return None, ok, tiers
        chunks = [kv for kv, _ in found if kv is not None]  # all ok: every one is there
        return (chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=2)), ok, tiers
