"""Loads of chunks stored a KV head per value (vLLM's keys, so any tensor-parallel size can
load them; connector/loader.py): each head's value lands in its heads' pages, as the joined
chunk would (compiled pages: without joining them), from any tier, and a value fetched from a
slower tier is promoted under its own key."""

from __future__ import annotations

import pytest
import torch

from connector.connector_config import make_config
from connector.connector_metrics import ConnectorMetrics
from connector.loader import Loader
from connector.metadata import LoadSpec
from connector.store_queue import StoreQueue
from connector.vllm.layouts import VllmCpuLayout
from kvkeys.keyspace import Keyspace
from kvstore.storage_manager import StorageManager

LAYERS, HEADS, HEAD_SIZE, BLOCK, CHUNK, NUM_BLOCKS = 2, 3, 16, 16, 32, 12
TOKENS = 3 * CHUNK
TABLE = [7, 2, 9, 4, 11, 1]


@pytest.mark.parametrize("kernels", [True, False])
def test_a_chunk_of_head_values_loads_into_every_heads_pages_and_promotes_by_head(kernels: bool) -> None:
    config = make_config(["cpu", "cpu"], chunk_size=CHUNK)
    storage = StorageManager.from_config(config.kvstore)
    layout = VllmCpuLayout(list(torch.zeros(LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE).unbind(0)),
                           kernels=kernels)
    assert (layout._ops is not None) == kernels, "engine/csrc did not build (needs g++)"
    keyspace = Keyspace("m+vllm-cpu", "float32.vec", CHUNK, LAYERS).for_heads(0, HEADS)
    assert keyspace.values_per_chunk == HEADS
    stores = StoreQueue(storage, 8, 1 << 24)
    loader = Loader(storage, stores, layout, keyspace, ConnectorMetrics())
    try:
        source = torch.randn(LAYERS, 2, TOKENS, HEADS, HEAD_SIZE)
        spans = keyspace.spans(list(range(TOKENS)))
        assert [sp.end for sp in spans] == [CHUNK, 2 * CHUNK, 3 * CHUNK]
        for i, sp in enumerate(spans):  # the first chunk only in the slower tier
            tier = storage.tiers[1 if i == 0 else 0]
            keys = keyspace.stored_keys([sp])
            tier.batched_put([(k, source[:, :, sp.start:sp.end, h:h + 1].clone()) for h, k in enumerate(keys)])
        end = TOKENS - 5  # ends inside the last chunk: part of its values move
        job = loader.submit(LoadSpec("r", 0, end, spans, [TABLE]))
        loader.wait_ended(job)
        assert job.filled == end and job.tiers == [1, 0, 0]
        assert torch.equal(layout.gather_chunk(layout.slots(TABLE, 0, end)), source[:, :, :end])
        untouched = [b for b in range(NUM_BLOCKS) if b not in TABLE]
        assert all(not kv[untouched].any() for kv in layout.kv_caches)
        assert stores.flush(timeout=60)
        first = keyspace.stored_keys(spans[:1])
        assert storage.tiers[0].batched_contains(first) == [True] * HEADS  # promoted, a value per head
        held = storage.tiers[0].batched_get(first)
        assert all(torch.equal(v, source[:, :, :CHUNK, h:h + 1]) for h, v in enumerate(held))
    finally:
        loader.close()
        storage.close()
