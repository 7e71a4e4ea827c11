"""What the model runner tells the model about one flattened batch (the model/runner seam).

Tokens of all scheduled sequences are concatenated into one flat batch of `num_tokens`
rows; sequence i owns rows `query_start_loc[i]:query_start_loc[i + 1]`. Before this step it
already had `seq_lens[i] - query_lens[i]` tokens of K/V in the paged cache (from earlier
steps, the prefix cache or a connector load); this step appends `query_lens[i]` more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    # [num_tokens] int64 on the model's device: the flat kv_cache slot each new token's K/V is
    # written to (`block_id * block_size + offset`), vLLM's slot_mapping.
    slot_mapping: torch.Tensor
    # [num_seqs, max_blocks_per_seq] int64 on the model's device, padded with 0.
    block_tables: torch.Tensor
    # Host-side lengths, used to split the batch; len(query_start_loc) == num_seqs + 1.
    query_start_loc: list[int]
    seq_lens: list[int]
    block_size: int
    # Optional worker-side KV connector (engine.kv_connector.KVConnectorBase); attention calls
    # `wait_for_layer_load(layer_idx)` before reading layer i and `save_kv_layer(layer_idx,
    # kv_cache, attn_metadata)` after writing it. None means no connector: no calls at all.
    kv_connector: Any | None = None
    # Free-form extras a connector may attach (e.g. CacheBlend state); the model ignores them.
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def query_lens(self) -> list[int]:
        q = self.query_start_loc
        return [q[i + 1] - q[i] for i in range(len(q) - 1)]
