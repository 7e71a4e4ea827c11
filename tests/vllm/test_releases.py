"""What changes between the vLLM releases the connector supports, checked against the one
installed (`make test-vllm VLLM_VERSION=...`; docs/vllm.md, "Releases")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from connector.vllm import KVTierConnector


def test_sleep_mode_is_refused_by_name() -> None:
    """vLLM 0.33 asks a connector before `--enable-sleep-mode` (asleep it frees the caches the
    worker side holds); kvtier's says no, so vLLM's own config check refuses the pair."""
    if not hasattr(KVConnectorBase_V1, "supports_sleep_mode"):
        pytest.skip("this vLLM (before 0.33) has no sleep-mode question for KV connectors")
    kvt = KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="connector.vllm",
                           kv_role="kv_both")
    assert KVTierConnector.supports_sleep_mode(kvt) is False
    config = SimpleNamespace(kv_transfer_config=kvt, model_config=SimpleNamespace(enable_sleep_mode=True))
    with pytest.raises(ValueError, match="KVTierConnector does not support sleep mode"):
        VllmConfig._verify_kv_transfer_compat(config)  # type: ignore[arg-type]
    config.model_config.enable_sleep_mode = False
    VllmConfig._verify_kv_transfer_compat(config)  # type: ignore[arg-type]
