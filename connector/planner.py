"""`KVTierPlanner`: the connector's scheduler side (docs/architecture.md, "Connector").

- Lookup (`get_num_new_matched_tokens`): starting at the chunk that holds the engine's own
  prefix-cache hit, the longest run of chunks held (connector/presence.py: some tier, or a
  pending store) is taken, capped so the last token is computed; where that run stops, the
  longest stored partial chunk starting there is taken too (a prompt that grew, a chat's next
  round, finds the partial tail its last round stored). Existence only: one question
  (`Presence.find`), which also says which tier holds each chunk (the load's hit
  sources); never a read of K/V.
- Plans (`update_state_after_alloc`, `build_connector_meta`): a hit becomes a `LoadSpec` for
  the worker side, in the background (the request waits for it) or, with `use_layerwise`, in
  the request's first step; chunks a step made storable become `SaveSpec`s (connector/
  save_plan.py). A finished request's generated tail is saved after it finished: its blocks
  are kept until the worker side has gathered it (`request_finished` returns True).
- An extension (connector/extension.py; CacheBlend's, connector/blend, when `blend.enabled`)
  is called at each hook: it may take a request at lookup and plan its K/V itself, adds its
  work to each step's metadata, and may keep a request out of prefix stores.

The partial-chunk rule (LMCache issue #2206, where a load rounded down to a chunk boundary
and overwrote blocks vLLM's prefix cache owned): loads cover only positions at or after the
engine's prefix-cache hit, i.e. blocks freshly allocated to the request and not yet in the
prefix cache; a chunk that straddles the hit is sliced at token granularity. Under that rule a
stored partial chunk (keyed by the chained hash of exactly its tokens) can only be loaded into
fresh blocks of a prompt with the identical prefix, so storing it is safe.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from connector.connector_config import ConnectorConfig
from connector.connector_metrics import ConnectorMetrics, RequestKVMetrics
from connector.extension import planner_extension
from connector.metadata import KVTierMeta, LoadSpec, SaveSpec
from connector.presence import Found, Presence
from connector.request_view import BlockIds, RequestView, StepRequest
from connector.save_plan import SavePlan, SavePolicy
from engine.kv_cache import KeyedModel
from engine.kv_connector import KVConnectorOutput, KVConnectorScheduler
from kvkeys.keyspace import Keyspace, RequestSpans, Span
from kvkeys.tenants import tenant_tag

if TYPE_CHECKING:
    from engine.scheduler_output import SchedulerOutput


@dataclass
class _Hit:
    """A lookup's answer for a waiting request: load positions [start, end) from `spans`, in
    the tiers `found` names."""

    num_tokens: int  # sequence length the lookup was made for
    start: int  # the engine's prefix-cache hit the lookup was made against
    end: int
    spans: list[Span] = field(default_factory=list)
    found: Found = field(default_factory=Found)


class KVTierPlanner(KVConnectorScheduler):
    """Plans loads and saves from existence alone.

    Guarantees: never reads or writes K/V; a load plan covers only positions past the
    engine's hit and before the last token; a request whose background load is in flight, or
    whose tail is still to be saved, keeps its blocks until the worker side reports it.
    """

    def __init__(self, config: ConnectorConfig, presence: Presence, metrics: ConnectorMetrics,
                 loads: bool = True, saves: bool = True, keyspace_of: Callable[[], Keyspace] | None = None) -> None:
        self.config = config
        self._keyspace_of = keyspace_of  # where register_model takes its keyspace (the worker's, in one process)
        self.loads = loads  # False: every lookup misses (a producer-only connector)
        self.saves = saves  # False: nothing is offered for saving (a consumer-only connector)
        self.presence = presence
        self.metrics = metrics
        self.layerwise = config.use_layerwise
        self.extension = planner_extension(config.extensions, presence, metrics)
        self.segment_separator = self.extension.segment_separator
        self._keyspace: Keyspace | None = None
        self._save_plan: SavePlan | None = None
        self.block_size = 0
        self._hits: dict[str, _Hit] = {}  # waiting requests with a lookup answer
        # Requests whose load failed: they recompute; offering the same chunks again could fail
        # again for ever (a value the tier keeps but the engine cannot take).
        self._load_failed: set[str] = set()
        self._loads: list[LoadSpec] = []  # planned since the last meta
        self._tail_saves: list[SaveSpec] = []  # of finished requests, since the last meta
        self._loading: dict[str, LoadSpec] = {}  # background loads not reported ended
        self._step_loads: dict[str, LoadSpec] = {}  # in-step loads of the last meta
        self._sources: dict[str, dict[str, int]] = {}  # a planned load's tokens per tier, until asked
        self._spans: dict[str, RequestSpans] = {}  # live requests' spans, extended as they grow
        self._no_save: set[str] = set()  # live requests that asked not to be stored

    # ---- set-up ------------------------------------------------------------------------
    def register_model(self, model_config: KeyedModel, kv_dtype: torch.dtype | str, block_size: int,
                       keyspace: Keyspace | None = None) -> None:
        """Takes the model, its K/V dtype and block size, and the keyspace chunks are keyed in
        (default: `keyspace_of()`'s, the one its worker built, else the model's, whole chunks)."""
        if keyspace is None:
            keyspace = self._keyspace_of() if self._keyspace_of is not None else \
                self.config.keyspace(model_config, kv_dtype)
        self._keyspace = keyspace
        self.block_size = block_size
        self._save_plan = SavePlan(SavePolicy(self.config.save_decode_tokens, self.config.save_unfull_chunk,
                                              self.saves), self._keyspace, self._spans_of)
        self.extension.register_model(model_config, self._keyspace, block_size)

    @property
    def keyspace(self) -> Keyspace:
        """Returns the keyspace; RuntimeError before `register_model`."""
        if self._keyspace is None:
            raise RuntimeError("the connector is not attached to an engine (register_model)")
        return self._keyspace

    def _spans_of(self, seq: RequestView) -> RequestSpans:
        """Returns the request's spans in its salt's keyspace, kept until it finishes."""
        spans = self._spans.get(seq.request_id)
        if spans is None:
            spans = self._spans[seq.request_id] = RequestSpans(self.keyspace.for_salt(seq.cache_salt))
        return spans

    def _saves(self) -> SavePlan:
        if self._save_plan is None:
            raise RuntimeError("the connector is not attached to an engine (register_model)")
        return self._save_plan

    # ---- lookup ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, seq: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        """Returns (how many tokens after `num_computed_tokens` are held, whether they load in
        the background: True, or layerwise in the request's first step: False); (0, False)
        on a miss. Never reaches the last token."""
        if seq.cache_salt is not None and self.metrics.live(seq.request_id).tenant is None:
            self.metrics.set_tenant(seq.request_id, tenant_tag(seq.cache_salt))  # its figures' label
        taken = self.extension.match(seq, num_computed_tokens)
        if taken is not None:
            return taken
        rid = seq.request_id
        n = seq.num_tokens
        hit = self._hits.get(rid)
        if hit is not None and (hit.num_tokens, hit.start) == (n, num_computed_tokens):
            return hit.end - hit.start, not self.layerwise
        self._hits.pop(rid, None)
        request_spans = self._spans_of(seq)
        ks = request_spans.keyspace  # a salt's chunks are its own
        limit = n - 1  # the last token's logits are needed
        if limit <= num_computed_tokens or not self.loads or rid in self._load_failed:
            return 0, False
        if num_computed_tokens % ks.token_multiple:  # whole tiles only: never into a block the engine holds
            return 0, False
        m = self.metrics.live(rid)
        m.num_prompt_tokens = seq.num_prompt_tokens
        m.engine_hit_tokens = num_computed_tokens
        tokens = seq.all_token_ids
        spans = request_spans.spans(tokens)
        first = num_computed_tokens // ks.chunk_size
        candidates = [sp for sp in spans[first:] if sp.start < limit]
        if not candidates:
            return 0, False
        base = candidates[0].start
        parent = spans[first - 1].chain if first else ks.root
        found = self.presence.find(ks, tokens[base:candidates[-1].end], base, candidates, parent, num_computed_tokens)
        wanted = candidates[:len(found.tiers)]
        if found.partial is not None:
            wanted.append(found.partial)
        end = min(wanted[-1].end, limit) if wanted else num_computed_tokens
        if end <= num_computed_tokens:
            return 0, False
        self._hits[rid] = _Hit(n, num_computed_tokens, end, wanted, found)
        return end - num_computed_tokens, not self.layerwise

    def load_sources(self, request_id: str) -> dict[str, int]:
        """Returns, once, the tokens of the load planned for `request_id` per tier name, from
        its lookup's answer (a chunk a pending store carries counts for the fastest tier, where
        it lands first); no I/O, and the load itself may find otherwise. {} when none is planned."""
        return self._sources.pop(request_id, {})

    # ---- plans -------------------------------------------------------------------------
    def update_state_after_alloc(self, seq: RequestView, block_ids: list[int], num_external_tokens: int) -> None:
        """Plans the request's load into `block_ids`, kvtier's engine's one block table (unless
        the extension took the request)."""
        if self.extension.admit(seq, block_ids, num_external_tokens):
            return
        self.plan_load(seq.request_id, [block_ids], num_external_tokens)

    def plan_load(self, request_id: str, block_ids: BlockIds, num_external_tokens: int) -> None:
        """Plans the load of the lookup's first `num_external_tokens` tokens into `block_ids` (per
        KV cache group), in the background or layerwise in the coming step; the loaded chunks
        are not offered for saving again. RuntimeError for tokens the lookup did not offer."""
        rid = request_id
        hit = self._hits.pop(rid, None)
        if num_external_tokens <= 0:
            return
        if hit is None or hit.start + num_external_tokens > hit.end:
            raise RuntimeError(f"request {rid}: asked to load {num_external_tokens} tokens "
                               "the connector did not offer")
        end = hit.start + num_external_tokens
        load = LoadSpec(rid, hit.start, end, [sp for sp in hit.spans if sp.start < end],
                        [list(t) for t in block_ids], layerwise=self.layerwise)
        self._loads.append(load)
        (self._step_loads if load.layerwise else self._loading)[rid] = load
        self._sources[rid] = hit.found.tokens_by_tier(hit.spans, hit.start, end)
        self._saves().skip_to(rid, end)

    def skip_saves(self, request_id: str) -> None:
        """Stores nothing of this request (its K/V is still loaded from what others stored)."""
        self._no_save.add(request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMeta:
        """Returns `plan_step` of kvtier's engine's step, with the extension's work for it."""
        work = self.extension.step_work(scheduler_output)
        meta = self.plan_step([StepRequest(r.seq, [r.block_ids], r.num_computed_tokens, r.num_new_tokens)
                               for r in scheduler_output.requests])
        meta.extension_work = work
        return meta

    def plan_step(self, steps: Sequence[StepRequest]) -> KVTierMeta:
        """Returns the loads planned since the last call, the chunks this step makes storable
        (not of requests the extension excludes, e.g. blended ones) and finished requests' tails."""
        meta = KVTierMeta(loads=self._loads, saves=self._tail_saves)
        self._loads, self._tail_saves = [], []
        plan = self._saves()
        for r in steps:
            rid = r.request.request_id
            if rid in self._no_save or self.extension.excludes_saves(rid):
                continue
            spans = plan.spans_to_save(r.request, r.num_computed_tokens + r.num_new_tokens)
            if spans:
                meta.saves.append(SaveSpec(rid, [list(t) for t in r.block_ids], spans, cache_salt=r.request.cache_salt))
        return meta

    def update_connector_output(self, output: KVConnectorOutput, failed: Collection[str] = ()) -> None:
        """Forgets ended background loads; a failed load's request saves its chunks again from
        its first bad position as they are recomputed, and loads nothing more (`failed`:
        requests whose load failed somewhere, from the load's start)."""
        step_loads, self._step_loads = self._step_loads, {}
        ended = [self._loading.pop(rid) for rid in output.finished_recving if rid in self._loading]
        bad = output.invalid_block_ids
        for load in [*ended, *step_loads.values()]:
            if load.request_id in failed:
                self._load_failed.add(load.request_id)
                self._saves().rewind(load.request_id, load.start)
                continue
            first = min((i for t in load.block_ids for i, b in enumerate(t) if b in bad), default=None)
            if first is not None:
                self._load_failed.add(load.request_id)
                self._saves().rewind(load.request_id, max(load.start, first * self.block_size))

    def is_loading(self, request_id: str) -> bool:
        """Returns whether the request's background load has not been reported ended."""
        return request_id in self._loading

    def request_finished(self, seq: RequestView, block_ids: list[int]) -> bool:
        """`finish` for kvtier's engine's one block table."""
        return self.finish(seq, [block_ids])

    def finish(self, seq: RequestView, block_ids: BlockIds) -> bool:
        """Plans the generated tail's save if configured; returns True (free the blocks only
        when the worker reports the request) if a load still writes them or a save will read
        them."""
        rid = seq.request_id
        self._hits.pop(rid, None)
        self._sources.pop(rid, None)
        self._load_failed.discard(rid)
        try:
            if self.extension.finish(rid):
                self._saves().forget(rid)
                return False  # nothing of it is stored (a blend: its K/V is approximate)
            if rid in self._loading:  # stopped by the worker at its next chunk, then reported
                self._saves().forget(rid)
                return True
            if rid in self._no_save:
                self._saves().forget(rid)
                return False
            tail = self._saves().finish(seq, min(len(t) for t in block_ids), self.block_size)
            if tail:
                self._tail_saves.append(SaveSpec(rid, [list(t) for t in block_ids], tail, release=True,
                                                    cache_salt=seq.cache_salt))
                return True
            return False
        finally:
            self._no_save.discard(rid)
            self._spans.pop(rid, None)
            self.metrics.finish(rid)

    def request_metrics(self, request_id: str) -> RequestKVMetrics:
        """Returns a request's connector figures (live or recently finished; all zero for a
        request the connector never saw or has forgotten)."""
        return self.metrics.request(request_id) or RequestKVMetrics(request_id)
