"""The worker side's stores: the step's storable chunks that no tier holds are gathered once
from the paged cache into the buffers every tier's write uses, and queued on the store thread
(connector/store_queue.py), so serving never waits on a tier (docs/architecture.md,
"Connector"). In layerwise mode each layer is gathered into its own value, stored under its
layer key; split by KV head, each head of the gathered chunk is its own value (a view, copied
out on the store thread) under its head key (kvkeys/keyspace.py).
"""

from __future__ import annotations

import functools

import torch

from connector.connector_metrics import ConnectorMetrics
from connector.key_families import FamilyIndex
from connector.metadata import SaveSpec
from connector.presence import Presence
from connector.store_queue import StoreQueue
from engine.kv_cache import PagedKVLayout
from kvkeys.keyspace import Keyspace, Span, layer_key


class Saver:
    """Gathers and queues planned saves. Guarantees: never blocks on a tier (a refused store
    is counted as dropped); a chunk some tier or pending store holds is not stored again."""

    def __init__(self, stores: StoreQueue, presence: Presence, layout: PagedKVLayout, keyspace: Keyspace,
                 metrics: ConnectorMetrics) -> None:
        self.stores = stores
        self.presence = presence
        self.layout = layout
        self.keyspace = keyspace
        self.metrics = metrics
        self.families = FamilyIndex.of(stores.storage)

    def store(self, saves: list[SaveSpec]) -> None:
        """Stores the chunks of `saves` that are not held (one existence query for all)."""
        held = iter(self.presence.chunks_held(self.keyspace, [sp for s in saves for sp in s.spans]))
        for save in saves:
            spans = [sp for sp in save.spans if not next(held)]
            if spans:
                self._store(save.request_id, save.block_ids, spans, save.cache_salt)

    def _store(self, request_id: str, block_ids: list[list[int]], spans: list[Span],
               cache_salt: str | None = None) -> None:
        """Gathers `spans` from `block_ids` (per KV cache group) now (once: the storage manager
        hands that buffer to every tier) and queues their put; a refused store is counted. A
        span some group holds no block for (a sliding window moved past it) is not stored."""
        layout = self.layout
        items: list[tuple[str, torch.Tensor]] = []
        stored: list[Span] = []
        for sp in spans:
            slots = layout.group_slots(block_ids, sp.start, sp.end)
            if bool((slots < 0).any()):
                continue
            stored.append(sp)
            if self.keyspace.layerwise:
                items += [(layer_key(sp.key, i), kv) for i, kv in enumerate(layout.gather_layers(slots))]
            else:
                items += self.keyspace.chunk_values(sp.key, layout.gather_chunk(slots))
        if not items:
            return
        nbytes = sum(kv.numel() * kv.element_size() for _, kv in items)
        ntokens = sum(sp.num_tokens for sp in stored)
        stored_now = functools.partial(self.metrics.add, request_id, stored_tokens=ntokens, bytes_stored=nbytes)
        family = self.families.note(self.keyspace.for_salt(cache_salt))

        def done() -> None:  # on the store thread, once the chunks are in their tiers
            stored_now()
            if family is not None:  # on the index thread: a hung shared tier must not hold the store thread
                self.families.publish_later(family)
        dropped = functools.partial(self.metrics.add, request_id, dropped_store_bytes=nbytes)
        if not self.stores.submit(items, done, dropped):
            dropped()
