"""kvtier inside vLLM: `KVTierConnector`, the class vLLM's KV connector v1 is configured with
(docs/vllm.md).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "connector.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"tiers": ["cpu?budget=4GiB"], "chunk_size": 256}}'

vLLM builds one instance per role, in different processes; constructing `KVTierConnector`
gives that role's own object: `VllmSchedulerConnector` (connector/vllm_scheduler.py: owns the
planner) in the scheduler process, `VllmWorkerConnector` (connector/vllm_worker.py: owns the
worker and the tiers) in each worker. What crosses between them each step is one picklable
`KVTierVllmMeta` and, back, vLLM's `KVConnectorOutput` (connector/vllm_metadata.py).

Keys: chunks computed by vLLM are keyed apart from chunks computed by kvtier's engine (and
by each vLLM backend): numerics differ at rounding level, so identical tokens hold only
within one engine. Tiers may be shared; the chunks are not mixed.
"""

from __future__ import annotations

from typing import Any

from connector.vllm_api import (
    KVConnectorBase_V1,
    KVConnectorPromMetrics,
    KVConnectorRole,
    KVConnectorStats,
    SupportsHMA,
)
from connector.vllm_metrics import KVTierPromMetrics, KVTierVllmStats
from connector.vllm_scheduler import VllmSchedulerConnector
from connector.vllm_worker import VllmWorkerConnector

__all__ = ["KVTierConnector"]


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """The connector class vLLM names: an instance is the role's own connector, and the
    class answers vLLM's class-level questions (stats, /metrics, hybrid KV cache support)."""

    def __new__(cls, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> Any:
        if role == KVConnectorRole.SCHEDULER:
            return VllmSchedulerConnector(vllm_config, role, kv_cache_config)
        return VllmWorkerConnector(vllm_config, role, kv_cache_config)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """Returns False: vLLM (0.33 on) then refuses `--enable-sleep-mode` with this connector
        by name. Asleep, vLLM frees the paged caches whose tensors the worker side holds, and a
        load or a finished request's tail save may still be writing or reading them."""
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVTierVllmStats.of(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
