"""kvtier inside vLLM: `KVTierConnector` for vLLM's KV connector v1 (docs/vllm.md).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "connector.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"tiers": ["cpu?budget=4GiB"], "chunk_size": 256}}'

vLLM builds one instance per role, in different processes: the scheduler role in EngineCore,
the worker role in the worker. Each instance only dispatches, to the same two halves kvtier's
engine drives: `VllmSchedulerSide` (connector/vllm_scheduler.py: the planner) or
`VllmWorkerSide` (connector/vllm_worker.py: loads, saves, tiers). What crosses between them
each step is one picklable `KVTierVllmMeta`; what comes back is vLLM's `KVConnectorOutput`.
This is the only module that imports vllm.

Keys: chunks computed by vLLM are keyed apart from chunks computed by kvtier's engine (and
by each vLLM backend): numerics differ at rounding level, so identical tokens hold only
within one engine. Tiers may be shared; the chunks are not mixed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import torch
import vllm

from connector.vllm_version import check_vllm_version

check_vllm_version(vllm.__version__)

# Imported after the version check, so an unsupported vLLM fails with one clear message.
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.platforms import current_platform  # noqa: E402

from connector.config import ConnectorConfig  # noqa: E402
from connector.keyspace import Keyspace  # noqa: E402
from connector.kv_events import ChunkEvent  # noqa: E402
from connector.lookup_channel import RemotePresence, lookup_socket_path  # noqa: E402
from connector.metadata import KVTierMeta  # noqa: E402
from connector.vllm_scheduler import VllmSchedulerSide  # noqa: E402
from connector.vllm_worker import COUNTERS, VllmWorkerSide, WorkerReport  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402

log = logging.getLogger(__name__)


@dataclasses.dataclass
class KVTierVllmMeta(KVConnectorMetadata):
    """One step's plans, as vLLM carries connector metadata; `idle`: no tokens scheduled."""

    meta: KVTierMeta
    idle: bool = False


@dataclasses.dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    """The worker's report back to the scheduler role (`WorkerReport`: stores still pending,
    tier changes for KV events), sent when there is news. While stores are pending the engine
    keeps stepping, so a draining shutdown (`--shutdown-timeout`) waits for them and their
    counters reach /metrics."""

    report: WorkerReport

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVTierWorkerMeta):
            self.report.merge(other.report)
        return self


@dataclasses.dataclass
class KVTierVllmStats(KVConnectorStats):
    """What the worker moved since its last report: counter deltas (see vllm_worker.COUNTERS)."""

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


_PROM_DOCS = {
    "connector_hit_tokens": "Prompt tokens loaded from kvtier's tiers instead of computed",
    "load_error_tokens": "Tokens promised by a lookup that could not be loaded (recomputed)",
    "bytes_loaded": "Bytes of K/V loaded from kvtier's tiers",
    "load_seconds": "Seconds spent fetching and scattering K/V",
    "stored_tokens": "Tokens of K/V chunks stored into kvtier's tiers",
    "bytes_stored": "Bytes of K/V stored into kvtier's tiers",
    "dropped_store_bytes": "Bytes not stored: the pending-store budget was full",
}


class KVTierPromMetrics(KVConnectorPromMetrics):
    """kvtier's figures on `vllm serve`'s /metrics: `kvtier:<counter>_total` per engine, and
    `kvtier:loaded_tokens_total` per tier."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._values = per_engine_labelvalues
        self._counters = {name: self._counter_cls(name=f"kvtier:{name}", documentation=doc, labelnames=labelnames)
                          for name, doc in _PROM_DOCS.items()}
        self._by_tier = self._counter_cls(name="kvtier:loaded_tokens", documentation="Tokens loaded, per tier",
                                          labelnames=[*labelnames, "tier"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self._values[engine_idx]
        for key, delta in transfer_stats_data.items():
            if key in self._counters:
                self._counters[key].labels(*values).inc(delta)
            elif key.startswith("loaded_tokens."):
                self._by_tier.labels(*values, key.removeprefix("loaded_tokens.")).inc(delta)


def _vllm_event(e: ChunkEvent) -> BlockStored | BlockRemoved:
    """Returns vLLM's KV event for one of kvtier's chunk events: one block per chunk, the
    chunk's chained hash as its hash, the tier as medium."""
    if e.kind == "removed":
        return BlockRemoved(block_hashes=[e.chain], medium=e.medium, ownership="kvtier")
    return BlockStored(block_hashes=[e.chain], parent_block_hash=e.parent, token_ids=list(e.token_ids),
                       block_size=len(e.token_ids), lora_id=None, medium=e.medium, lora_name=None,
                       ownership="kvtier")


def _backend() -> str:
    """Returns the layout family of this platform's attention backend."""
    return "cpu" if current_platform.is_cpu() else "flash"


def _check_cpu_isa(kv: torch.Tensor) -> None:
    """Raises ValueError if vLLM's CPU kernels pack this cache's pages (AMX tiles), a layout
    kvtier does not read; the "vec" kernels' layout is `VllmCpuLayout`'s."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    _, _, block_size, two_d = kv.shape
    isa = _get_attn_isa(kv.dtype, block_size, two_d // 2)
    if isa not in ("vec", "vec16"):
        raise ValueError(f"KVTierConnector: vLLM's CPU attention uses the {isa!r} kernels here, whose KV "
                         "layout kvtier does not support; use float32 (or a CPU without AMX)")


def _setup(vllm_config: Any) -> tuple[ConnectorConfig, ModelConfig, torch.dtype]:
    """Returns the connector config (extra config over $KVTIER_CONFIG / KVTIER_*), the model
    as kvtier keys it (tagged with this engine and backend) and the KV dtype; ValueError
    for a setup this connector does not support."""
    kvt = vllm_config.kv_transfer_config
    config = ConnectorConfig.load(overrides=kvt.kv_connector_extra_config or {})
    par = vllm_config.parallel_config
    if par.tensor_parallel_size != 1 or par.pipeline_parallel_size != 1:
        raise ValueError("KVTierConnector supports tensor_parallel_size=1 and pipeline_parallel_size=1 only")
    if vllm_config.cache_config.cache_dtype not in ("auto", None):
        raise ValueError(f"KVTierConnector: kv_cache_dtype {vllm_config.cache_config.cache_dtype!r} "
                         "is not supported; use 'auto'")
    model = ModelConfig.from_pretrained(vllm_config.model_config.model)
    model = dataclasses.replace(model, fingerprint=f"{model.fingerprint}+vllm-{_backend()}")
    return config, model, vllm_config.model_config.dtype


def connector_keyspace(vllm_config: Any) -> Keyspace:
    """Returns the keyspace KVTierConnector's scheduler side keys chunks in for `vllm_config`,
    so another process of the same server (its API server: connector/vllm_lookup_route.py)
    can ask the worker's tiers about a prompt; ValueError as `_setup`."""
    config, model, kv_dtype = _setup(vllm_config)
    return Keyspace(model.fingerprint, kv_dtype, config.chunk_size, model.num_layers, layerwise=config.use_layerwise)


class KVTierConnector(KVConnectorBase_V1):
    """vLLM's connector class for kvtier: dispatches each hook to this role's half."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config, model, kv_dtype = _setup(vllm_config)
        kvt = vllm_config.kv_transfer_config
        self._sched: VllmSchedulerSide | None = None
        self._worker: VllmWorkerSide | None = None
        self._stores_pending = False  # the worker's last report (scheduler role)
        self._events: list[BlockStored | BlockRemoved] = []  # for take_events
        ev = vllm_config.kv_events_config
        events = ev is not None and bool(ev.enable_kv_cache_events)
        if role == KVConnectorRole.SCHEDULER:
            presence = RemotePresence(lookup_socket_path(kvt.engine_id))
            self._sched = VllmSchedulerSide(config, presence, model, kv_dtype, vllm_config.cache_config.block_size,
                                            loads=kvt.is_kv_consumer, saves=kvt.is_kv_producer, events=events)
        else:
            self._worker = VllmWorkerSide(config, model, kvt.engine_id, _backend(), events=events)

    def _s(self) -> VllmSchedulerSide:
        if self._sched is None:
            raise RuntimeError("a scheduler-role hook was called on the worker-role KVTierConnector")
        return self._sched

    def _w(self) -> VllmWorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-role hook was called on the scheduler-role KVTierConnector")
        return self._worker

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache, not a hand-off: a request preempted while its save is pending just recomputes.
        return False

    # ---- scheduler role ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._s().update_state_after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVTierVllmMeta(self._s().build_connector_meta(scheduler_output),
                              idle=scheduler_output.total_num_scheduled_tokens == 0)

    def update_connector_output(self, connector_output: Any) -> None:
        s = self._s()
        s.update_connector_output(connector_output.finished_sending, connector_output.finished_recving,
                                  connector_output.invalid_block_ids)
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVTierWorkerMeta):
            self._stores_pending = meta.report.stores_pending
            self._events += [_vllm_event(e) for e in s.chunk_events(meta.report.stored, meta.report.removed)]

    def has_pending_push_work(self) -> bool:
        # Keeps vLLM stepping while the worker's stores are queued (see KVTierWorkerMeta).
        return self._stores_pending

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request, block_ids), None

    def take_events(self) -> Iterable[Any]:
        events, self._events = self._events, []
        return events

    # ---- worker role -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        w = self._w()
        if w.backend == "cpu" and kv_caches:
            _check_cpu_isa(next(iter(kv_caches.values())))
        w.register_kv_caches(kv_caches)
        log.info("kvtier connector ready: %s", w.info())

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, KVTierVllmMeta):
            raise TypeError(f"expected KVTierVllmMeta, got {type(connector_metadata).__name__}")
        self._w().bind(connector_metadata.meta, connector_metadata.idle)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._w().clear()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # Saves gather their chunks inside the step that plans them (wait_for_save), so no
        # read of a preempted request's blocks outlives the step: nothing to wait for.
        return None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._w().start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._w().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # whole chunks are gathered across layers in wait_for_save

    def wait_for_save(self) -> None:
        self._w().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._w().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w().get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        delta = self._worker.stats_delta()
        return KVTierVllmStats(data=delta) if delta else None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = self._w().report()
        return None if report is None else KVTierWorkerMeta(report)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVTierVllmStats(data={k: v for k, v in (data or {}).items()
                                     if k in COUNTERS or k.startswith("loaded_tokens.")})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
