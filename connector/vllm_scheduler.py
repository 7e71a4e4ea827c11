"""vLLM's scheduler role, in kvtier's terms: `KVTierPlanner` driven by vLLM's requests and
scheduler output (connector/vllm.py dispatches here; docs/vllm.md).

vLLM hands the scheduler role its own `Request` objects and `SchedulerOutput`; the planner
speaks kvtier's `Sequence` and `SchedulerOutput`. This module keeps one mirror `Sequence` per
live request (tokens appended as vLLM samples them, block table from the step's
`kv_connector_block_state`) and translates each hook, so the planning itself is the one
kvtier's own engine uses. It never imports vllm: vLLM's objects are read by attribute.

The worker's tiers live in the worker process, so the planner's existence questions go
there (connector/lookup_channel.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from connector.config import ConnectorConfig
from connector.kv_events import ChunkEvent, ChunkEventBuilder, TierKey
from connector.metadata import KVTierMeta
from connector.metrics import ConnectorMetrics
from connector.planner import KVTierPlanner
from connector.presence import ChunkPresence
from engine.kv_connector import KVConnectorOutput
from engine.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.sequence import Sequence

SKIP_SAVE_PARAMS = ("kvtier.skip_save", "lmcache.skip_save")
"""A request's `kv_transfer_params` key that, set to true, keeps its K/V out of the tiers
(LMCache's name is honoured too); it still loads what others stored."""


@dataclass
class _Mirror:
    """A live vLLM request and the kvtier Sequence that mirrors it."""

    request: Any  # vllm.v1.request.Request
    seq: Sequence


class VllmSchedulerSide:
    """`KVTierPlanner` behind vLLM's scheduler-role hooks.

    Guarantees: a lookup never claims the last prompt token and answers `load_async=False`
    whenever it claims nothing; a request's mirror is dropped when vLLM finishes it.
    """

    def __init__(self, config: ConnectorConfig, presence: ChunkPresence, model_config: ModelConfig,
                 kv_dtype: torch.dtype, block_size: int, loads: bool = True, saves: bool = True,
                 events: bool = False) -> None:
        if config.blend.enabled:
            raise ValueError("CacheBlend (blend.enabled) is not supported inside vLLM yet; "
                             "use kvtier's engine for blended prompts")
        self.metrics = ConnectorMetrics()
        # kv_consumer loads only, kv_producer saves only, kv_both does both
        self.planner = KVTierPlanner(config, presence, self.metrics, loads=loads, saves=saves)
        self.planner.register_model(model_config, kv_dtype, block_size)
        self._live: dict[str, _Mirror] = {}
        # events: the planned chunks' tokens, and finished requests' mirrors until their tail is planned
        self.events = ChunkEventBuilder(self.planner.keyspace) if events else None
        self._finished: dict[str, Sequence] = {}

    def _mirror(self, request: Any) -> Sequence:
        """Returns the request's mirror, its output tokens and computed count brought up to date."""
        m = self._live.get(request.request_id)
        if m is None:
            # vLLM's own cache_salt (validated by its front end): the request's chunks are keyed apart
            seq = Sequence(request.request_id, list(request.prompt_token_ids or ()), SamplingParams(),
                           cache_salt=getattr(request, "cache_salt", None) or None)
            m = self._live[request.request_id] = _Mirror(request, seq)
            params = getattr(request, "kv_transfer_params", None) or {}
            if any(params.get(k) is True for k in SKIP_SAVE_PARAMS):
                self.planner.skip_saves(request.request_id)
        out = request.output_token_ids
        have = len(m.seq.output_token_ids)
        if len(out) < have:  # vLLM rewound the output (a preempted request's stale tokens)
            del m.seq.output_token_ids[len(out):]
            have = len(out)
        m.seq.output_token_ids.extend(out[have:])
        m.seq.num_computed_tokens = request.num_computed_tokens
        return m.seq

    # ---- hooks -------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Returns (tokens after vLLM's own hit held by the tiers, load them asynchronously)."""
        seq = self._mirror(request)
        n, load_async = self.planner.get_num_new_matched_tokens(seq, num_computed_tokens)
        return n, bool(n) and load_async

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """Plans the load of `num_external_tokens` into the request's blocks."""
        seq = self._mirror(request)
        seq.block_table = list(block_ids)
        self.planner.update_state_after_alloc(seq, seq.block_table, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVTierMeta:
        """Returns this step's plans for the worker: the loads planned since the last step
        and the chunks this step makes storable."""
        block_state = scheduler_output.kv_connector_block_state
        steps: list[ScheduledRequest] = []
        counts = scheduler_output.num_scheduled_tokens
        new = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        for rid, computed in [*new, *zip(cached.req_ids, cached.num_computed_tokens)]:
            m = self._live.get(rid)
            if m is None:  # admitted without a lookup (vLLM asks for every new request)
                continue
            seq = self._mirror(m.request)
            if block_state is not None:
                seq.block_table = list(block_state.get_block_ids(rid)[0])
            steps.append(ScheduledRequest(seq, computed, counts.get(rid, 0)))
        meta = self.planner.build_connector_meta(SchedulerOutput(
            requests=steps, finished_req_ids=set(scheduler_output.finished_req_ids)))
        if self.events is not None:
            for save in meta.saves:
                m = self._live.get(save.request_id)
                saved = m.seq if m is not None else self._finished.get(save.request_id)
                if saved is not None:
                    self.events.planned(save, saved.all_token_ids, saved.cache_salt)
            self._finished.clear()
        return meta

    def chunk_events(self, stored: list[TierKey], removed: list[TierKey]) -> list[ChunkEvent]:
        """Returns the KV events of the worker's tier changes (none unless events are on)."""
        return self.events.events(stored, removed) if self.events is not None else []

    def update_connector_output(self, finished_sending: set[str] | None, finished_recving: set[str] | None,
                                invalid_block_ids: set[int] | None) -> None:
        """Hands the worker's report to the planner."""
        self.planner.update_connector_output(KVConnectorOutput(
            set(finished_sending or ()), set(finished_recving or ()), set(invalid_block_ids or ())))

    def request_finished(self, request: Any, block_ids: list[int]) -> bool:
        """Returns True when the request's blocks must stay until the worker reports it in
        `finished_sending` (its tail is still to be gathered). A request whose load is still
        running returns False: vLLM itself keeps those blocks until `finished_recving`."""
        rid = request.request_id
        seq = self._mirror(request)
        loading = self.planner.is_loading(rid)
        try:
            keep = self.planner.request_finished(seq, list(block_ids))
        finally:
            self._live.pop(rid, None)
        if keep and self.events is not None:  # its tail is planned in the next meta
            self._finished[rid] = seq
        return keep and not loading
