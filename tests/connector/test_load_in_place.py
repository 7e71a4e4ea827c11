"""The loader reading a disk tier's chunks straight into the engine's blocks (no read buffer):
the right K/V lands in exactly the loaded positions, scattered blocks and a load that starts
or ends inside a chunk included; a corrupt chunk stops the load there; tiers that cannot
read in place, or a tier below a faster one, go through a buffer as before."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from connector.connector_config import make_config
from connector.connector_metrics import ConnectorMetrics
from connector.loader import Loader
from connector.metadata import LoadSpec
from connector.store_queue import StoreQueue
from engine.kv_cache import EngineLayout
from kvkeys.keyspace import Keyspace, Span
from kvstore.backends.disk import DiskBackend
from kvstore.storage_manager import StorageManager

LAYERS, HEADS, HEAD_SIZE, BLOCK, CHUNK = 3, 2, 8, 4, 16
TOKENS = 5 * CHUNK + 6  # five whole chunks and a partial one
BLOCKS = -(-TOKENS // BLOCK)


@dataclass
class Rig:
    storage: StorageManager
    loader: Loader
    layout: EngineLayout
    spans: list[Span]
    source: torch.Tensor  # the stored K/V, (layers, 2, TOKENS, heads, head_size)

    def disk(self) -> DiskBackend:
        tier = self.storage.tiers[-1]
        assert isinstance(tier, DiskBackend)
        return tier

    def load(self, start: int, end: int, block_ids: list[int]) -> int:
        spans = [sp for sp in self.spans if sp.end > start and sp.start < end]
        job = self.loader.submit(LoadSpec(f"r{start}-{end}", start, end, spans, [block_ids]))
        self.loader.wait_ended(job)
        return job.filled


@contextmanager
def rig(tmp_path: Path, urls: list[str], dtype: torch.dtype = torch.float32) -> Iterator[Rig]:
    """Stores TOKENS tokens of random K/V through the real saver path's layout, in `urls`."""
    config = make_config(urls, chunk_size=CHUNK)
    storage = StorageManager.from_config(config.kvstore)
    caches = torch.zeros(LAYERS, 2, 3 * BLOCKS, BLOCK, HEADS, HEAD_SIZE, dtype=dtype)
    layout = EngineLayout(list(caches.unbind(0)))
    keyspace = Keyspace("test-model", dtype, CHUNK, LAYERS)
    stores = StoreQueue(storage, config.store_queue_size, config.max_pending_store_bytes)
    loader = Loader(storage, stores, layout, keyspace, ConnectorMetrics())
    try:
        source = torch.randn(LAYERS, 2, TOKENS, HEADS, HEAD_SIZE).to(dtype)
        spans = keyspace.spans(list(range(1, TOKENS + 1)))
        storage.batched_put([(sp.key, source[:, :, sp.start:sp.end].clone()) for sp in spans])
        assert storage.flush(timeout=60)
        yield Rig(storage, loader, layout, spans, source)
    finally:
        loader.close()
        storage.close()


def scattered_blocks(seed: int) -> list[int]:
    """A block table of BLOCKS blocks, out of order, with gaps, none of them block 0."""
    ids = random.Random(seed).sample(range(1, 3 * BLOCKS), BLOCKS)
    assert ids != sorted(ids)
    return ids


def held(r: Rig, block_ids: list[int], start: int, end: int) -> torch.Tensor:
    return r.layout.gather_chunk(r.layout.slots(block_ids, start, end))


def untouched_outside(r: Rig, block_ids: list[int], start: int, end: int) -> bool:
    """Whether every slot of every layer other than positions [start, end) still holds zeros."""
    written = set(r.layout.slots(block_ids, start, end).tolist())
    others = torch.tensor([s for s in range(r.layout.num_slots) if s not in written])
    return bool((r.layout.gather_chunk(others) == 0).all())


@pytest.mark.parametrize("start, end", [(0, TOKENS), (CHUNK + 5, TOKENS), (3, 2 * CHUNK + 7), (CHUNK, 4 * CHUNK)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_disk_load_lands_in_exactly_its_positions(tmp_path: Path, start: int, end: int, dtype: torch.dtype) -> None:
    with rig(tmp_path, [f"disk://{tmp_path}/kv"], dtype) as r:
        assert r.loader._in_place
        ids = scattered_blocks(start + end)
        assert r.load(start, end, ids) == end
        assert torch.equal(held(r, ids, start, end), r.source[:, :, start:end])
        assert untouched_outside(r, ids, start, end)
        disk = r.disk()
        assert disk._read_buffers.reused == 0 and disk._read_buffers.free_bytes == 0  # no buffer taken
        assert disk.stats().hits == len([sp for sp in r.spans if sp.end > start and sp.start < end])


def test_a_corrupt_chunk_stops_the_load_at_its_start(tmp_path: Path) -> None:
    with rig(tmp_path, [f"disk://{tmp_path}/kv"]) as r:
        bad = r.spans[2]
        path = r.disk()._path(bad.key)
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x10
        path.write_bytes(data)
        ids = scattered_blocks(7)
        assert r.load(0, TOKENS, ids) == bad.start
        assert torch.equal(held(r, ids, 0, bad.start), r.source[:, :, :bad.start])
        assert r.disk().stats().corrupt == 1 and not path.exists()


@pytest.mark.parametrize("urls", [["cpu", "disk"], ["disk?codec=lz4"]])
def test_tiers_that_do_not_read_in_place_load_as_before(tmp_path: Path, urls: list[str]) -> None:
    urls = [u.replace("disk", f"disk://{tmp_path}/kv") for u in urls]
    with rig(tmp_path, urls) as r:
        assert not r.loader._in_place
        if len(urls) > 1:
            r.storage.tiers[0].clear()  # served from the disk tier below
        ids = scattered_blocks(3)
        assert r.load(CHUNK + 5, TOKENS, ids) == TOKENS
        assert torch.equal(held(r, ids, CHUNK + 5, TOKENS), r.source[:, :, CHUNK + 5:])
        assert untouched_outside(r, ids, CHUNK + 5, TOKENS)
