"""The vLLM edge: every name kvtier's connector takes from vLLM, imported here once, after
the version check, with the differences between supported releases resolved here and
nowhere else (docs/vllm.md, "Releases").

Modules of the adapter import vLLM through this one (`from connector.vllm.vllm_api import ...`),
so an unsupported vLLM fails with one clear message before any of its names is touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import vllm

from connector.kv_events import ChunkEvent
from connector.vllm.version import check_vllm_version

check_vllm_version(vllm.__version__)

# Imported after the version check, so an unsupported vLLM fails with one clear message.
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.platforms import current_platform  # noqa: E402

try:  # 0.32: vLLM counts cached tokens per source; earlier releases neither have nor ask for it
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - 0.30, 0.31
    CacheHitSource = None

LOGGER = "vllm.kvtier"
"""The adapter's logger: under vLLM's own, so its lines appear in vLLM's log, in vLLM's format."""

__all__ = ["LOGGER", "BlockRemoved", "BlockStored", "CacheHitSource", "KVConnectorBase_V1", "KVConnectorMetadata",
           "KVConnectorPromMetrics", "KVConnectorRole", "KVConnectorStats", "KVConnectorTransferResults",
           "KVConnectorWorkerMetadata", "SupportsHMA", "attention_backend", "cpu_attention_isa", "prefix_cache_tokens",
           "tensor_parallel_rank", "vllm_event"]


def tensor_parallel_rank() -> int:
    """Returns this worker's tensor-parallel rank (0 without tensor parallel)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def attention_backend() -> str:
    """Returns the layout family of this platform's attention backend ("cpu" or "flash")."""
    return "cpu" if current_platform.is_cpu() else "flash"


def cpu_attention_isa(dtype: object, block_size: int, head_size: int, kv_cache_dtype: str = "auto") -> str:
    """Returns the kernels vLLM's CPU attention picks for a model of `dtype` over these caches
    ("vec", "vec16", "amx", ...)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(dtype, block_size, head_size, kv_cache_dtype))


def prefix_cache_tokens(kv_cache_manager: Any, hash_algo: str, token_ids: Sequence[int],
                        cache_salt: str | None) -> int:
    """Returns how many leading tokens of a prompt vLLM's own prefix cache holds for a request
    of `cache_salt` (base model, text only), never the last token, as vLLM's own lookup caps it;
    0 when prefix caching is off. Only reads the block pool: no block is touched or taken, and
    vLLM's prefix-cache stats are not counted, so it may run beside the scheduler's thread."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher

    if not kv_cache_manager.enable_caching or len(token_ids) < 2:
        return 0
    ids = list(token_ids)
    # The attributes vLLM's block hasher reads of a request (0.30-0.32), as a plain prompt has them.
    prompt = SimpleNamespace(block_hashes=[], num_tokens=len(ids), all_token_ids=ids, cache_salt=cache_salt,
                             mm_features=[], lora_request=None, prompt_embeds=None)
    hasher = get_request_block_hasher(kv_cache_manager.block_pool.hash_block_size, get_hash_fn_by_name(hash_algo))
    _, tokens, *_ = kv_cache_manager.coordinator.find_longest_cache_hit(hasher(prompt), len(ids) - 1)
    return int(tokens)


def vllm_event(e: ChunkEvent) -> BlockStored | BlockRemoved:
    """Returns vLLM's KV event for one of kvtier's chunk events: one block per chunk, the
    chunk's chained hash as its hash, the tier as medium."""
    if e.kind == "removed":
        return BlockRemoved(block_hashes=[e.chain], medium=e.medium, ownership="kvtier")
    return BlockStored(block_hashes=[e.chain], parent_block_hash=e.parent, token_ids=list(e.token_ids),
                       block_size=len(e.token_ids), lora_id=None, medium=e.medium, lora_name=None,
                       ownership="kvtier")
