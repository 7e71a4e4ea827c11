"""kvtier's scheduler role inside vLLM: `VllmSchedulerConnector` owns the planner and hands it
vLLM's own requests (connector/request_view.py) and block tables (docs/vllm.md).

The worker's tiers live in the worker process, so the planner's existence questions go
there (connector/vllm/lookup_channel.py), and so does `reset_cache`. vLLM's own prefix cache lives
in this process: the scheduler side answers, on its own socket, how much of a prompt it holds
(connector/vllm/engine_prefix.py, for `vllm serve`'s /kv/lookup).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from connector.connector_metrics import ConnectorMetrics
from connector.kv_events import ChunkEventBuilder
from connector.planner import KVTierPlanner
from connector.request_view import StepRequest
from connector.vllm.engine_prefix import EnginePrefixServer
from connector.vllm.lookup_channel import LookupClient
from connector.vllm.roles import SchedulerRole
from connector.vllm.setup import hit_sources, vllm_setup
from connector.vllm.vllm_api import (
    LOGGER,
    BlockRemoved,
    BlockStored,
    CacheHitSource,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    attention_backend,
    cpu_attention_isa,
    vllm_event,
)
from connector.vllm.vllm_meta import KVTierVllmMeta, KVTierWorkerMeta
from engine.kv_connector import KVConnectorOutput

log = logging.getLogger(LOGGER)

SKIP_SAVE_PARAMS = ("kvtier.skip_save", "lmcache.skip_save")
"""A request's `kv_transfer_params` key that, set to true, keeps its K/V out of the tiers
(LMCache's name is honoured too); it still loads what others stored."""


class VllmSchedulerConnector(SchedulerRole, KVConnectorBase_V1):  # KVTierConnector's scheduler role
    """The scheduler role: lookups, load and save plans, KV events.

    Guarantees: a lookup never claims the last prompt token and answers `load_async=False`
    whenever it claims nothing; a request is forgotten when vLLM finishes it.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        setup = vllm_setup(vllm_config, kv_cache_config, attention_backend(), cpu_attention_isa)
        kvt = vllm_config.kv_transfer_config
        self.metrics = ConnectorMetrics()
        self.presence = setup.worker_presence(kvt.engine_id)  # every tensor-parallel rank's tiers
        self.planner = KVTierPlanner(setup.config, self.presence, self.metrics, loads=setup.loads, saves=setup.saves)
        self.planner.register_model(setup.model, setup.kv_dtype, setup.block_size, setup.keyspace())
        self._requests: dict[str, Any] = {}  # vLLM's live requests a lookup saw
        self.events = ChunkEventBuilder(self.planner.keyspace) if setup.events else None
        self._finished: dict[str, Any] = {}  # finished requests whose tail the next meta plans (events)
        self._events: list[BlockStored | BlockRemoved] = []
        self._stores_pending = False  # the worker's last report
        self._engine_id = kvt.engine_id
        self._hash_algo = vllm_config.cache_config.prefix_caching_hash_algo
        self._prefix_server: EnginePrefixServer | None = None
        policy = kvt.kv_load_failure_policy
        if setup.loads and policy != "recompute":
            log.warning("KVTierConnector: kv_load_failure_policy=%r: a request whose stored K/V turns out lost or "
                        "corrupt when loaded ends with an error; set \"kv_load_failure_policy\": \"recompute\" in "
                        "--kv-transfer-config to recompute it instead", policy)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """Takes vLLM's cache manager and answers how much of a prompt its prefix cache holds
        (connector/vllm/engine_prefix.py) until `shutdown()`."""
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._prefix_server is None:
            self._prefix_server = EnginePrefixServer(kv_cache_manager, self._hash_algo, self._engine_id)

    def shutdown(self) -> None:
        """Stops answering prefix-cache questions."""
        if self._prefix_server is not None:
            self._prefix_server.close()
            self._prefix_server = None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache, not a hand-off: a request preempted while its save is pending recomputes

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        if rid not in self._requests:
            self._requests[rid] = request
            params = request.kv_transfer_params or {}
            if any(params.get(k) is True for k in SKIP_SAVE_PARAMS):
                self.planner.skip_saves(rid)
        if request.skip_reading_prefix_cache:  # its prompt logprobs need every position computed
            return 0, False
        n, load_async = self.planner.get_num_new_matched_tokens(request, num_computed_tokens)
        return n, bool(n) and load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.planner.plan_load(request.request_id, blocks.get_block_ids(), num_external_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        sources = hit_sources(self.planner.load_sources(request.request_id), num_external_tokens)
        return {CacheHitSource[name]: n for name, n in sources.items()}

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        block_state = scheduler_output.kv_connector_block_state
        counts = scheduler_output.num_scheduled_tokens
        cached = scheduler_output.scheduled_cached_reqs
        steps = []
        for rid, computed in [*((r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs),
                              *zip(cached.req_ids, cached.num_computed_tokens)]:
            request = self._requests.get(rid)
            if request is not None:  # else admitted without a lookup (vLLM asks for every new request)
                steps.append(StepRequest(request, block_state.get_block_ids(rid), computed, counts.get(rid, 0)))
        meta = self.planner.plan_step(steps)
        if self.events is not None:
            for save in meta.saves:
                saved = self._requests.get(save.request_id) or self._finished.get(save.request_id)
                if saved is not None:
                    self.events.planned(save, list(saved.all_token_ids), saved.cache_salt)
            self._finished.clear()
        return KVTierVllmMeta(meta, idle=scheduler_output.total_num_scheduled_tokens == 0)

    def update_connector_output(self, connector_output: Any) -> None:
        out = connector_output
        self.planner.update_connector_output(
            KVConnectorOutput(set(out.finished_sending or ()), set(out.finished_recving or ()),
                              set(out.invalid_block_ids or ())), failed=set(out.failed_recving or ()))
        report = out.kv_connector_worker_meta
        if isinstance(report, KVTierWorkerMeta):
            self._stores_pending = report.stores_pending
            if self.events is not None:
                self._events += [vllm_event(e) for e in self.events.events(report.stored, report.removed)]

    def has_pending_push_work(self) -> bool:
        return self._stores_pending  # vLLM keeps stepping while the worker's stores are queued

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Returns (keep the blocks until the worker names the request in `finished_sending`:
        its tail is still to be gathered, None). A request whose load still runs returns False:
        vLLM keeps those blocks itself until `finished_recving`."""
        rid = request.request_id
        loading = self.planner.is_loading(rid)
        try:
            keep = self.planner.finish(request, block_ids)
        finally:
            self._requests.pop(rid, None)
        if keep and self.events is not None:  # its tail is planned in the next meta
            self._finished[rid] = request
        return keep and not loading, None

    def take_events(self) -> Iterable[Any]:
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> bool:
        """Clears the worker's process-local tiers (cpu, device); shared tiers (disk, Redis, the
        cache server) serve other instances and are left as they are, unless the configuration
        says `reset_clears_shared_tiers`. False if the worker does not answer."""
        return all([rank.clear_local() for rank in self.presence.ranks if isinstance(rank, LookupClient)])
