"""Loads over vLLM pages moved as whole tiles (connector/vllm/layouts.py, `VllmTileLayout`):
a load that ends inside a block (before a prompt's last token) moves that block's tile whole,
reports only its own tokens, and writes no other block, whole chunks and layer by layer."""

from __future__ import annotations

import torch

from connector.connector_config import make_config
from connector.connector_metrics import ConnectorMetrics
from connector.loader import Loader
from connector.metadata import LoadSpec
from connector.store_queue import StoreQueue
from connector.vllm.layouts import VllmTileLayout
from kvkeys.keyspace import Keyspace, layer_key
from kvstore.storage_manager import StorageManager

LAYERS, HEADS, HEAD_SIZE, BLOCK, CHUNK, NUM_BLOCKS = 2, 2, 8, 4, 16, 16
TOKENS = 2 * CHUNK + 2 * BLOCK  # two whole chunks and a partial one of two whole blocks
TABLE = [9, 3, 14, 1, 7, 12, 5, 10, 2, 11]  # out of order, none of them block 0


def run_load(layerwise: bool, end: int) -> tuple[int, VllmTileLayout, torch.Tensor, list[int]]:
    """Stores TOKENS tokens of tile chunks in a cpu tier, loads [0, end) into TABLE's blocks;
    returns (the load's filled end, the layout, the stored chunks joined, the blocks written)."""
    config = make_config(["cpu"], chunk_size=CHUNK, use_layerwise=layerwise)
    storage = StorageManager.from_config(config.kvstore)
    layout = VllmTileLayout(list(torch.zeros(LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE).unbind(0)))
    assert layout.tokens_per_move == BLOCK
    keyspace = Keyspace("m+vllm-cpu", "float32.vec-tiles-b4", CHUNK, LAYERS, layerwise=layerwise,
                        token_multiple=BLOCK)
    loader = Loader(storage, StoreQueue(storage, 8, 1 << 24), layout, keyspace, ConnectorMetrics())
    try:
        source = torch.randn(LAYERS, 2, TOKENS, HEADS, HEAD_SIZE)
        spans = keyspace.spans(list(range(1, TOKENS + 2)))  # the prompt's last token is never stored
        assert spans[-1].end == TOKENS
        if layerwise:
            storage.batched_put([(layer_key(sp.key, i), source[i:i + 1, :, sp.start:sp.end].clone())
                                 for sp in spans for i in range(LAYERS)])
        else:
            storage.batched_put([(sp.key, source[:, :, sp.start:sp.end].clone()) for sp in spans])
        assert storage.flush(timeout=60)
        wanted = [sp for sp in spans if sp.start < end]
        job = loader.submit(LoadSpec("r", 0, end, wanted, [TABLE], layerwise=layerwise))
        loader.wait_ended(job)
        return job.filled, layout, source, TABLE[:-(-end // BLOCK)]
    finally:
        loader.close()
        storage.close()


def check(layerwise: bool) -> None:
    end = 2 * CHUNK + BLOCK + 1  # inside the partial chunk's second block
    filled, layout, source, written = run_load(layerwise, end)
    assert filled == end  # what the engine is told: its own tokens
    whole = len(written) * BLOCK  # what moved: every block it touches, whole
    slots = layout.slots(written, 0, whole)
    assert torch.equal(layout.gather_chunk(slots), source[:, :, :whole])
    others = [b for b in range(NUM_BLOCKS) if b not in written]
    assert all(not kv[others].any() for kv in layout.kv_caches)


def test_a_load_ending_inside_a_block_moves_its_tile_whole() -> None:
    check(layerwise=False)


def test_a_layerwise_load_ending_inside_a_block_moves_its_tile_whole() -> None:
    check(layerwise=True)
