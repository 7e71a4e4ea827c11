"""`KVTierConnector`, the class vLLM's KV connector v1 is configured with, and its two roles.

vLLM builds one instance per role, in different processes; constructing `KVTierConnector`
gives that role's own subclass: `VllmSchedulerConnector` (connector/vllm/scheduler.py: owns
the planner) in the scheduler process, `VllmWorkerConnector` (connector/vllm/worker.py: owns
the worker and the tiers) in each worker. What crosses between them each step is one
picklable `KVTierVllmMeta` and, back, vLLM's `KVConnectorOutput` (connector/vllm/metadata.py).

Keys: chunks computed by vLLM are keyed apart from chunks computed by kvtier's engine (and
by each vLLM backend): numerics differ at rounding level, so identical tokens hold only
within one engine. Tiers may be shared; the chunks are not mixed.
"""

from __future__ import annotations

from typing import Any, ClassVar, NoReturn

from connector.vllm.api import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorPromMetrics,
    KVConnectorRole,
    KVConnectorStats,
    SupportsHMA,
)
from connector.vllm.stats import KVTierPromMetrics, KVTierVllmStats

__all__ = ["KVTierConnector", "SchedulerRole", "WorkerRole"]


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """The connector class vLLM names: an instance is its role's subclass, and the class
    answers vLLM's class-level questions (stats, /metrics, sleep mode)."""

    roles: ClassVar[dict[str, type[KVTierConnector]]] = {}
    """Each role's subclass, by role ("scheduler", "worker"): registered by its definition
    (connector/vllm/__init__.py imports both before handing out this class)."""

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


def _other_role(hook: str, role: str) -> NoReturn:
    raise RuntimeError(f"{hook} is a {role}-role hook")


class SchedulerRole(KVTierConnector, KVConnectorBase_V1):  # vLLM's abstract base declares both roles' hooks
    """Base of the scheduler role's connector: the worker role's hooks, which vLLM never calls
    on it, refuse with the hook's name."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        KVTierConnector.roles["scheduler"] = cls

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        _other_role("start_load_kv", "worker")

    def wait_for_layer_load(self, layer_name: str) -> None:
        _other_role("wait_for_layer_load", "worker")

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        _other_role("save_kv_layer", "worker")

    def wait_for_save(self) -> None:
        _other_role("wait_for_save", "worker")


class WorkerRole(KVTierConnector, KVConnectorBase_V1):
    """Base of the worker role's connector: the scheduler role's hooks refuse."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        KVTierConnector.roles["worker"] = cls

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        _other_role("get_num_new_matched_tokens", "scheduler")

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        _other_role("update_state_after_alloc", "scheduler")

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        _other_role("build_connector_meta", "scheduler")

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        _other_role("request_finished_all_groups", "scheduler")
