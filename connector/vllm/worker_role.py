"""kvtier's worker role inside vLLM: `VllmWorkerConnector` owns the worker, over vLLM's paged
caches and tiers opened in this process (docs/vllm.md).

vLLM names its per-layer caches (`model.layers.3.self_attn.attn`) and lays them out per
attention backend; they are ordered by layer and wrapped in that backend's `PagedKVLayout`
(connector/vllm/layouts.py), each layer in its KV cache group. This process also answers the
scheduler process's existence questions (connector/vllm/lookup_channel.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from connector.connector_metrics import ConnectorMetrics
from connector.explain import explain
from connector.kv_events import TierChangeLog
from connector.vllm.control_ops import answer_control
from connector.vllm.layouts import NULL_BLOCK, vllm_layout_for
from connector.vllm.lookup_channel import LookupServer, lookup_socket_path
from connector.vllm.roles import WorkerRole
from connector.vllm.setup import vllm_setup
from connector.vllm.stats import StatsReports
from connector.vllm.vllm_api import (
    LOGGER,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorStats,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    attention_backend,
    cpu_attention_isa,
    tensor_parallel_rank,
)
from connector.vllm.vllm_meta import KVTierVllmMeta, WorkerReports
from connector.worker import KVTierWorker
from kvstore.deadlines import STORE_FLUSH_TIMEOUT_S, VLLM_IDLE_WAIT_S
from kvstore.storage_manager import StorageManager

log = logging.getLogger(LOGGER)


class VllmWorkerConnector(WorkerRole, KVConnectorBase_V1):  # KVTierConnector's worker role
    """The worker role: loads, saves, the tiers and the lookup channel.

    Guarantees: the lookup channel answers from this worker's `LocalHeldKeys` (pending stores
    included) from construction until `shutdown()`; `shutdown()` lets queued stores finish
    and closes the tiers, once.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.backend = attention_backend()
        self.setup = vllm_setup(vllm_config, kv_cache_config, self.backend, cpu_attention_isa)
        self.storage = StorageManager.from_config(self.setup.config.kvstore)
        changes = TierChangeLog() if self.setup.events else None  # what the tiers stored and removed (KV events)
        if changes is not None:
            self.storage.set_listener(changes)
        self.reports = WorkerReports(changes)
        self.metrics = ConnectorMetrics()
        self.worker = KVTierWorker(self.setup.config, self.storage, self.metrics)
        self.worker.register_model(self.setup.model)
        self.rank = tensor_parallel_rank() if self.setup.tp_size > 1 else 0
        self.keyspace = self.setup.rank_keyspace(self.rank)
        self.stats = StatsReports(self.metrics, self.rank)
        self._layers: dict[str, int] = {}
        path = lookup_socket_path(vllm_config.kv_transfer_config.engine_id, self.rank)
        local_only = not self.setup.config.reset_clears_shared_tiers
        self._server = LookupServer(self.worker.held_keys, path, self.keyspace,
                                    clear_local=lambda: self.storage.clear(local_only=local_only),
                                    explainer=self._explain, controller=self._control)
        self._idle = False
        self._closed = False

    def _explain(self, token_ids: list[int], cache_salt: str | None, other_tenants: bool) -> dict[str, Any]:
        """The lookup channel's `ExplainQuestion`: why this rank's tiers hold no more of a prompt."""
        return explain(self.storage, self.keyspace.for_salt(cache_salt), self.worker.presence, token_ids,
                       other_tenants)

    def _control(self, question: dict[str, Any]) -> dict[str, Any]:
        """The lookup channel's `ControlQuestion`: a cache-control op (inspect, pin, unpin, clear, ...)
        answered from this rank's tiers and KV heads by connector/cache_control.py, as kvtier
        serve's routes are; queued stores land first (within STORE_FLUSH_TIMEOUT_S)."""
        return answer_control(self.storage, self.keyspace, question,
                              flush=lambda: self.worker.flush(STORE_FLUSH_TIMEOUT_S))

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Takes vLLM's named per-layer caches (layers 0..L-1, in one or more KV cache groups)."""
        names, caches, layer_groups = self.setup.ordered_caches(kv_caches, self.backend)
        self._layers = {n: i for i, n in enumerate(names)}
        layout = vllm_layout_for(caches, self.backend, layer_groups, self.setup.page_decoder)
        self.worker.register_layout(layout, self.keyspace)
        log.info("kvtier connector ready: backend %s (%s), %d layers in %d KV cache group(s), KV heads %s of rank %d, "
                 "%d bytes per token, keyed as %s", self.backend, type(layout).__name__, len(names),
                 self.setup.num_groups, self.keyspace.heads, self.rank, layout.bytes_per_token(),
                 self.keyspace.kv_dtype)

    # ---- the step ----------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, KVTierVllmMeta):
            raise TypeError(f"expected KVTierVllmMeta, got {type(connector_metadata).__name__}")
        self.worker.bind_connector_metadata(connector_metadata.meta)
        self._idle = connector_metadata.idle  # vLLM steps only for the connector

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.worker.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker.start_load_kv(None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(self._layers[layer_name])

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # whole chunks are gathered across layers in wait_for_save

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Returns (requests whose tail was gathered, requests whose load ended) since the last
        call. On an idle step it first waits, up to VLLM_IDLE_WAIT_S seconds, for a load in flight
        to end, else for queued stores to land: the engine neither spins hot nor reports a
        finished load one poll late (it steps again at once after)."""
        if self._idle:
            if self.worker.loads_in_flight():
                self.worker.wait_for_finished(VLLM_IDLE_WAIT_S)
            elif self.worker.stores_pending():
                self.worker.flush(VLLM_IDLE_WAIT_S)
        return self.worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """`get_finished`, with the requests whose load failed as `failed_recving` where vLLM
        cannot map failed blocks back to requests (several KV cache groups): they recompute."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self.worker.failed_loads() if self.setup.num_groups > 1 else set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self.worker.get_block_ids_with_load_errors() - {NULL_BLOCK}  # shared by every window
        return errors if self.setup.num_groups == 1 else set()  # reported per request instead

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.stats.report()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.reports.report(self.worker.stores_pending())

    def shutdown(self) -> None:
        """Stops the lookup channel, lets queued stores finish, closes the tiers."""
        if self._closed:
            return
        self._closed = True
        self._server.close()
        try:
            self.worker.shutdown()
        finally:
            self.storage.close(self.worker.flush_time_left())  # within the worker's flush bound
