"""The connector's store side: which chunks a step made storable, and gathering them once
into the buffers every tier's write uses (docs/architecture.md, "Connector").

After each step, chunks that became complete (full prompt chunks, the prompt's partial last
chunk, decode chunks if enabled) and that no tier (nor a pending store) holds are gathered
from the paged cache and handed to the store queue, so serving never waits on a tier. In
layerwise mode each layer is gathered into its own tensor, stored under its layer key.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from connector.gather import gather_chunk, gather_layers, slots_for
from connector.layerwise import layer_key, stored_keys
from connector.loader import Span
from connector.metrics import ConnectorMetrics
from connector.store_queue import StoreQueue
from kvstore.storage_manager import StorageManager

if TYPE_CHECKING:
    from engine.sequence import Sequence


@dataclass
class SaveSpec:
    request_id: str
    block_ids: list[int]
    spans: list[Span]


@dataclass
class SavePolicy:
    """What gets stored: `chunk_size`, decode tokens too, the prompt's partial last chunk."""

    chunk_size: int
    save_decode_tokens: bool
    save_unfull_chunk: bool


class Saver:
    """Per request, the positions already considered for storing. Guarantees: a span is
    offered once unless `rewind` says it is computed again; stores never block."""

    def __init__(self, policy: SavePolicy, spans: Callable[[SequenceT[int], bool], list[Span]],
                 storage: StorageManager, stores: StoreQueue, kv_caches: list[torch.Tensor], block_size: int,
                 layers: int | None, metrics: ConnectorMetrics) -> None:
        self.policy = policy
        self._spans = spans
        self.storage = storage
        self.stores = stores
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.layers = layers  # values per chunk in layerwise mode, else None
        self.metrics = metrics
        self._saved_upto: dict[str, int] = {}

    def spans_to_save(self, seq: Sequence, computed: int) -> list[Span]:
        """Returns the spans that became storable with `computed` tokens in the cache and that
        no tier (nor a pending store) holds yet; marks them considered."""
        rid = seq.request_id
        done = self._saved_upto.get(rid, 0)
        p = seq.num_prompt_tokens
        cs = self.policy.chunk_size
        # Decode tokens only in whole chunks here; their partial tail is saved at finish.
        limit = computed if self.policy.save_decode_tokens else min(computed, p)
        full_end = limit // cs * cs
        unfull = self.policy.save_unfull_chunk and computed >= p and p % cs and limit == p
        new_end = p if unfull and p > full_end else full_end
        if new_end <= done:
            return []
        self._saved_upto[rid] = new_end
        spans = [sp for sp in self._spans(seq.token_ids_slice(0, new_end), bool(unfull)) if sp[1] > done]
        return self.not_stored(spans)

    def not_stored(self, spans: list[Span]) -> list[Span]:
        """Returns the spans neither a tier nor a pending store holds (stored prefix skipped)."""
        spans = [sp for sp in spans if not all(map(self.stores.is_pending, stored_keys([sp[2]], self.layers)))]
        if not spans:
            return spans
        held = self.storage.prefix_hits(stored_keys([k for _, _, k in spans], self.layers))
        return spans[held // (self.layers or 1):]

    def rewind(self, request_id: str, position: int) -> None:
        """Considers the request's chunks from the one holding `position` again (recomputed)."""
        cs = self.policy.chunk_size
        self._saved_upto[request_id] = min(self._saved_upto.get(request_id, 0), position // cs * cs)

    def finish(self, seq: Sequence, block_ids: list[int], store_tail: bool) -> None:
        """Forgets the request; with `store_tail` first stores its generated tail chunk (if
        configured) from `block_ids`, still held during this call."""
        rid = seq.request_id
        try:
            p = self.policy
            if store_tail and p.save_decode_tokens and p.save_unfull_chunk and block_ids:
                computed = min(seq.num_computed_tokens, len(block_ids) * self.block_size)
                done = self._saved_upto.get(rid, 0)
                if computed > done:
                    spans = [sp for sp in self._spans(seq.token_ids_slice(0, computed), True) if sp[1] > done]
                    self.store(SaveSpec(rid, list(block_ids), self.not_stored(spans)))
        finally:
            self._saved_upto.pop(rid, None)

    def store(self, save: SaveSpec) -> None:
        """Gathers `save`'s chunks from the paged cache now (once: the storage manager hands
        that buffer to every tier) and queues their put; a refused store is counted."""
        if not save.spans:
            return
        items: list[tuple[str, torch.Tensor]] = []
        for s, e, key in save.spans:
            slots = slots_for(save.block_ids, self.block_size, s, e)
            if self.layers is not None:
                items += [(layer_key(key, i), kv) for i, kv in enumerate(gather_layers(self.kv_caches, slots))]
            else:
                items.append((key, gather_chunk(self.kv_caches, slots)))
        nbytes = sum(kv.numel() * kv.element_size() for _, kv in items)
        ntokens = sum(e - s for s, e, _ in save.spans)
        rid = save.request_id
        done = functools.partial(self.metrics.add, rid, stored_tokens=ntokens, bytes_stored=nbytes)
        dropped = functools.partial(self.metrics.add, rid, dropped_store_bytes=nbytes)
        if not self.stores.submit(items, done, dropped):
            dropped()
