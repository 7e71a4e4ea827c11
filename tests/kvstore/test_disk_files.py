"""The disk tier's file layout (kvstore/backends/disk/file_format.py): each value's payload starts on
a cache line of the file, files written before the file header still load, and a file header
that lies is a miss, never a wrong value."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from kvstore import serde
from kvstore.backends.disk import DiskBackend
from kvstore.backends.disk.file_format import FILE_MAGIC, PAYLOAD_ALIGN, value_start
from tests.fixtures.scattered import Scattered
from tests.fixtures.tiers import chunk, ckey


@pytest.mark.parametrize("codec, kv", [
    ("raw", chunk(0)), ("lz4", chunk(0)), ("int8", chunk(0)),
    ("raw", chunk(1, tokens=7, dtype=torch.float32)), ("lz4", chunk(1, tokens=7, dtype=torch.float32)),
    ("raw", torch.randn(3, 5)),
], ids=["raw", "lz4", "int8", "raw-fp32-7-tokens", "lz4-fp32-7-tokens", "raw-2-d"])
@pytest.mark.parametrize("integrity", [False, True])
def test_every_payload_starts_on_a_cache_line(tmp_path: Path, codec: str, kv: torch.Tensor, integrity: bool) -> None:
    serde.set_integrity_key("a-test-integrity-secret-0123" if integrity else None)
    try:
        disk = DiskBackend(tmp_path, codec=codec)
        disk.put(ckey(0), kv)
        data = disk._path(ckey(0)).read_bytes()
        start = value_start(data)
        header = serde.read_header(data[start:])
        assert data[:4] == FILE_MAGIC and (start + header.header_len) % PAYLOAD_ALIGN == 0
        assert header.has_mac == integrity and start + header.header_len + header.payload_len == len(data)
        expected = serde.decode(ckey(0), serde.encode(ckey(0), kv, codec))
        assert torch.equal(serde.decode(ckey(0), data[start:]), expected)
        assert torch.equal(disk.get(ckey(0)), expected)
        assert disk.stats().bytes_used >= len(data)
    finally:
        serde.set_integrity_key(None)


def test_files_written_before_the_file_header_still_load(tmp_path: Path) -> None:
    old = DiskBackend(tmp_path)
    old.put(ckey(0), chunk(0))
    old.put(ckey(1), chunk(1))
    for i in (0, 1):  # as earlier versions wrote them: the value alone
        old._path(ckey(i)).write_bytes(bytes(serde.encode(ckey(i), chunk(i))))
    disk = DiskBackend(tmp_path)
    assert torch.equal(disk.get(ckey(0)), chunk(0))
    into = Scattered(chunk(1), 4096)
    assert disk.batched_read_into([ckey(1)], [into.dest])[0] is into.dest
    assert torch.equal(into.chunk(chunk(1)), chunk(1)) and into.outside_untouched()
    s = disk.stats()
    assert (s.hits, s.corrupt) == (2, 0)


@pytest.mark.parametrize("start", [0, 4, 16, 200, 2**32 - 1])  # 16: inside the zeros, 200: past them
def test_a_file_header_that_lies_is_a_miss(tmp_path: Path, start: int) -> None:
    disk = DiskBackend(tmp_path)
    for i in (0, 1):
        disk.put(ckey(i), chunk(i))
        path = disk._path(ckey(i))
        data = bytearray(path.read_bytes())
        struct.pack_into("<I", data, len(FILE_MAGIC), start)
        path.write_bytes(data)
    assert disk.get(ckey(0)) is None
    into = Scattered(chunk(1), 4096)
    assert disk.batched_read_into([ckey(1)], [into.dest]) == [None]
    s = disk.stats()
    assert (s.hits, s.corrupt) == (0, 2)
    assert not disk._path(ckey(0)).exists() and not disk._path(ckey(1)).exists()
