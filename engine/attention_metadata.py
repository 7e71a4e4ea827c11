"""What the model runner tells the model about one flattened batch (the model/runner seam).

Tokens of all scheduled sequences are concatenated into one flat batch of `num_tokens`
rows; sequence i owns rows `query_start_loc[i]:query_start_loc[i + 1]`. Before this step it
already had `seq_lens[i] - query_lens[i]` tokens of K/V in the paged cache (from earlier
steps, the prefix cache or a connector load); this step appends `query_lens[i]` more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class LayerKVHooks(Protocol):
    """What the model calls on a KV connector's worker side, per layer
    (engine.kv_connector.KVConnectorWorker has both)."""

    def wait_for_layer_load(self, layer_idx: int) -> None: ...

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata) -> None: ...


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
    # Optional KV connector worker side; attention calls `wait_for_layer_load(layer_idx)`
    # before reading layer i and `save_kv_layer(layer_idx, kv_cache, attn_metadata)` after
    # writing it. None means no connector: no calls at all.
    kv_connector: LayerKVHooks | None = None

    def last_token_rows(self, seqs: list[int]) -> list[int]:
        """Returns the flat rows of sequences `seqs`' last new tokens, in that order."""
        return [self.query_start_loc[i + 1] - 1 for i in seqs]

    def last_rows(self, seqs: list[int]) -> tuple[list[int], AttentionMetadata]:
        """Returns (`last_token_rows(seqs)`, the metadata of a batch of just those rows: each one
        query at its position over its sequence's keys, all already in the cache, and no
        connector)."""
        rows = self.last_token_rows(seqs)
        index = torch.tensor(seqs, dtype=torch.long, device=self.block_tables.device)
        return rows, AttentionMetadata(
            slot_mapping=self.slot_mapping[torch.tensor(rows, dtype=torch.long, device=self.slot_mapping.device)],
            block_tables=self.block_tables.index_select(0, index),
            query_start_loc=list(range(len(seqs) + 1)),
            seq_lens=[self.seq_lens[i] for i in seqs],
            block_size=self.block_size,
        )
