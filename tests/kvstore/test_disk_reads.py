"""Reading disk-tier values straight into the caller's memory (`batched_read_into`): the bytes
land where the destination says, checked as `get` checks them; anything corrupt, truncated,
padded or foreign is a miss, and a value that is not raw K/V of the destination's shape and
dtype is read as `get` reads it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore import serde
from kvstore.backend import Destination
from kvstore.backends.disk import DiskBackend
from kvstore.backends.disk.file_format import value_start
from kvstore.backends.memory import CPUBackend
from kvstore.storage_manager import StorageManager
from tests.fixtures.scattered import Scattered
from tests.fixtures.tiers import chunk, ckey


@pytest.mark.parametrize("piece", [64, 4096, 1 << 20])  # 64: more views than one preadv takes
@pytest.mark.parametrize("integrity", [False, True])
def test_read_into_puts_every_byte_where_the_destination_says(tmp_path: Path, piece: int, integrity: bool) -> None:
    serde.set_integrity_key("a-test-integrity-secret-0123" if integrity else None)
    try:
        disk = DiskBackend(tmp_path)
        kv = chunk(1, tokens=256 if piece > 4096 else 64)  # 256 tokens: 786 KB, one view over serde.CHECK_PIECE
        disk.put(ckey(1), kv)
        into = Scattered(kv, piece)
        assert disk.reads_in_place
        assert disk.batched_read_into([ckey(1)], [into.dest])[0] is into.dest
        assert torch.equal(into.chunk(kv), kv) and into.outside_untouched()
        s = disk.stats()
        assert (s.hits, s.misses, s.corrupt) == (1, 0, 0)
    finally:
        serde.set_integrity_key(None)


def test_corrupt_truncated_padded_and_foreign_values_are_misses(tmp_path: Path) -> None:
    disk = DiskBackend(tmp_path)
    for i in range(5):
        disk.put(ckey(i), chunk(i))
    paths = [disk._path(ckey(i)) for i in range(5)]
    payload = bytearray(paths[0].read_bytes())
    payload[-100] ^= 0x01  # one bit of the payload
    paths[0].write_bytes(payload)
    header = bytearray(paths[1].read_bytes())
    header[value_start(header) + 30] ^= 0x01  # one bit of the value's header (num_tokens): the checksum covers it too
    paths[1].write_bytes(header)
    paths[2].write_bytes(paths[2].read_bytes()[:-7])
    paths[3].write_bytes(paths[3].read_bytes() + b"extra")
    paths[4].write_bytes(bytes(serde.encode(ckey(9), chunk(9))))  # another key's valid value
    for i in range(5):
        into = Scattered(chunk(i), 4096)
        assert disk.batched_read_into([ckey(i)], [into.dest]) == [None], i
        assert into.outside_untouched()
    s = disk.stats()
    assert (s.hits, s.misses, s.corrupt) == (0, 5, 5)
    assert not any(p.exists() for p in paths)  # refused values are dropped, not read again
    assert disk.batched_read_into([ckey(0)], [Scattered(chunk(0), 4096).dest]) == [None]  # now absent: a plain miss
    assert disk.stats().corrupt == 5


def test_without_the_integrity_key_a_value_is_refused_in_place(tmp_path: Path) -> None:
    disk = DiskBackend(tmp_path)
    disk.put(ckey(0), chunk(0))  # written with no MAC
    serde.set_integrity_key("a-test-integrity-secret-0123")
    try:
        assert disk.batched_read_into([ckey(0)], [Scattered(chunk(0), 4096).dest]) == [None]
        assert disk.stats().corrupt == 1
    finally:
        serde.set_integrity_key(None)


def test_values_that_are_not_raw_kv_of_that_shape_are_read_as_get_reads_them(tmp_path: Path) -> None:
    disk = DiskBackend(tmp_path)
    DiskBackend(tmp_path, codec="lz4").put(ckey(0), chunk(0))  # another writer's codec
    disk.put(ckey(1), chunk(1, dtype=torch.float32))
    disk.put(ckey(2), chunk(2, tokens=8))
    disk.put(ckey(3), chunk(3))
    stored = [chunk(0), chunk(1, dtype=torch.float32), chunk(2, tokens=8)]
    for i in range(3):
        into = Scattered(chunk(i), 4096)  # float16, 16 tokens
        [got] = disk.batched_read_into([ckey(i)], [into.dest])
        assert isinstance(got, torch.Tensor) and torch.equal(got, stored[i])
        assert into.untouched()
    assert disk.stats().corrupt == 0

    manager = StorageManager([disk])
    dests = [Scattered(chunk(i), 4096) for i in range(5)]
    got = manager.fetch([ckey(i) for i in range(5)], into=[d.dest for d in dests])
    assert torch.equal(got[0][0], chunk(0)) and torch.equal(got[1][0], chunk(1, dtype=torch.float32))
    assert torch.equal(got[2][0], chunk(2, tokens=8))
    assert got[3] == (dests[3].dest, 0) and torch.equal(dests[3].chunk(chunk(3)), chunk(3))
    assert got[4] == (None, -1)  # never stored
    stats = next(iter(manager.stats().values()))
    loaded = [chunk(0), chunk(1, dtype=torch.float32), chunk(2, tokens=8), chunk(3)]
    assert stats.hits == 4 and stats.misses == 1 and stats.bytes_loaded == sum(kv.nbytes for kv in loaded)


def test_only_the_fastest_tier_reads_in_place(tmp_path: Path) -> None:
    """A hit below the fastest tier is promoted, so it is read into memory it can keep."""
    assert not StorageManager([DiskBackend(tmp_path / "lz4", codec="lz4")]).reads_in_place
    disk = DiskBackend(tmp_path / "raw")
    two = StorageManager([CPUBackend(), disk])
    assert StorageManager([disk]).reads_in_place and not two.reads_in_place
    disk.put(ckey(0), chunk(0))
    into = Scattered(chunk(0), 4096)
    (kv, tier), = two.fetch([ckey(0)], into=[into.dest])
    assert tier == 1 and torch.equal(kv, chunk(0)) and into.untouched()


def test_a_destination_takes_only_writable_byte_views() -> None:
    kv = chunk(0)
    arena = np.zeros(kv.nbytes, dtype=np.uint8)
    with pytest.raises(ValueError, match="byte views"):
        Destination(tuple(kv.shape), kv.dtype, [memoryview(arena.view(np.float16))])
    with pytest.raises(ValueError, match="byte views"):
        Destination(tuple(kv.shape), kv.dtype, [memoryview(bytes(kv.nbytes))])
