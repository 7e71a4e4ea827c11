"""The base class of each role's connector inside vLLM.

vLLM's `KVConnectorBase_V1` declares both roles' hooks abstract, and vLLM builds one object per
role (connector/vllm/connector.py's `KVTierConnector` picks it). Each role's connector extends
its base here, where the other role's hooks, which vLLM never calls on it, refuse with the
hook's name, and its definition registers it as that role's.
"""

from __future__ import annotations

from typing import Any, NoReturn

from connector.vllm.connector import KVTierConnector
from connector.vllm.vllm_api import KVConnectorBase_V1, KVConnectorMetadata


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
