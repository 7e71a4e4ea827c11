"""`KVTierConnector`, the class vLLM's KV connector v1 is configured with, and its two roles.

vLLM builds one instance per role, in different processes; constructing `KVTierConnector`
gives that role's own subclass: `VllmSchedulerConnector` (connector/vllm/scheduler_role.py: owns
the planner) in the scheduler process, `VllmWorkerConnector` (connector/vllm/worker_role.py: owns
the worker and the tiers) in each worker. What crosses between them each step is one
picklable `KVTierVllmMeta` and, back, vLLM's `KVConnectorOutput` (connector/vllm/vllm_meta.py).

Keys: chunks computed by vLLM are keyed apart from chunks computed by kvtier's engine (and
by each vLLM backend): numerics differ at rounding level, so identical tokens hold only
within one engine. Tiers may be shared; the chunks are not mixed.
"""

from __future__ import annotations

from typing import Any, ClassVar

from connector.vllm.stats import KVTierPromMetrics, KVTierVllmStats
from connector.vllm.vllm_api import (
    KVConnectorBase_V1,
    KVConnectorPromMetrics,
    KVConnectorRole,
    KVConnectorStats,
    SupportsHMA,
)

__all__ = ["KVTierConnector"]


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """The connector class vLLM names: an instance is its role's subclass, and the class
    answers vLLM's class-level questions (stats, /metrics, sleep mode)."""

    roles: ClassVar[dict[str, type[KVTierConnector]]] = {}
    """Each role's subclass, by role ("scheduler", "worker"): registered by its definition
    (connector/vllm/roles.py; connector/vllm/__init__.py imports both before handing out this
    class)."""

    def __new__(cls, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> KVTierConnector:
        if cls is KVTierConnector:
            cls = KVTierConnector.roles["scheduler" if role == KVConnectorRole.SCHEDULER else "worker"]
        return super().__new__(cls)  # Python then runs the role's own __init__, once

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
