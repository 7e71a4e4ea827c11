"""kvtier inside vLLM: everything vLLM-specific, one package (docs/vllm.md).

Users name it in vLLM's KV transfer config, which is unchanged:

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "connector.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"tiers": ["cpu?budget=4GiB"], "chunk_size": 256}}'

The package imports kvtier's core and nothing in the core imports it. Only `api.py` (after
`version.py`'s check) imports vllm, and `KVTierConnector` is loaded on first use, so the
layouts, the setup and the version check import without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":  # imports vllm: only where vLLM asks for the class
        import connector.vllm.scheduler_role  # noqa: F401  (each role's subclass registers itself)
        import connector.vllm.worker_role  # noqa: F401
        from connector.vllm.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
