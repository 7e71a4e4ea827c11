"""The disk tier on a real directory: restart recovery, LRU across restarts, corruption, failures."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from kvstore import serde
from kvstore.backend import BackendError, leading_run
from kvstore.backends.disk import STATE_BYTES, DiskBackend
from kvstore.backends.disk.file_names import keys_with_prefix
from tests.fixtures.tiers import chunk, ckey, disk_file_bytes


def _files(root: Path) -> list[Path]:
    return sorted(root.glob("*.kvc"))


def test_survives_restart_with_lru_order(tmp_path: Path) -> None:
    root = tmp_path / "d"
    one = disk_file_bytes(tmp_path / "probe", chunk(0))
    budget = 3 * one + STATE_BYTES  # the directory's state file counts too
    disk = DiskBackend(root, byte_budget=budget, codec="raw")
    for i in range(3):
        disk.put(ckey(i), chunk(i))
        time.sleep(0.01)
    assert disk.get(ckey(0)) is not None  # 0 is now the most recently used
    disk.close()
    (root / ".tmp-leftover").write_bytes(b"half a write")  # a crash mid-write

    again = DiskBackend(root, byte_budget=budget, codec="raw")
    assert not (root / ".tmp-leftover").exists()
    s = again.stats()
    assert s.entries == 3 and s.bytes_used == sum(p.stat().st_size for p in _files(root)) + STATE_BYTES
    for i in range(3):
        assert torch.equal(again.get(ckey(i)), chunk(i))
    # reads above were 0,1,2 in order; a fresh restart keeps that order (mtime)
    again = DiskBackend(root, byte_budget=budget, codec="raw")
    again.put(ckey(3), chunk(3))
    assert [again.contains(ckey(i)) for i in range(4)] == [False, True, True, True]


def test_lowered_budget_trims_on_start(tmp_path: Path) -> None:
    disk = DiskBackend(tmp_path)
    for i in range(4):
        disk.put(ckey(i), chunk(i))
        time.sleep(0.01)
    one = _files(tmp_path)[0].stat().st_size
    small = DiskBackend(tmp_path, byte_budget=2 * one + STATE_BYTES)
    assert small.stats().bytes_used <= 2 * one + STATE_BYTES
    assert [small.contains(ckey(i)) for i in range(4)] == [False, False, True, True]


def test_another_process_files_are_found(tmp_path: Path) -> None:
    a, b = DiskBackend(tmp_path), DiskBackend(tmp_path)
    a.put(ckey(5), chunk(5))
    assert leading_run(b.batched_contains([ckey(5)])) == 1 and torch.equal(b.get(ckey(5)), chunk(5))


@pytest.mark.parametrize("codec", ["raw", "lz4", "int8"])
def test_corrupt_truncated_and_foreign_files_are_misses(tmp_path: Path, codec: str) -> None:
    disk = DiskBackend(tmp_path, codec=codec)
    for i in range(3):
        disk.put(ckey(i), chunk(i))
    f0, f1, f2 = (disk._path(ckey(i)) for i in range(3))
    data = bytearray(f0.read_bytes())
    data[len(data) // 2] ^= 0x40
    f0.write_bytes(data)
    f1.write_bytes(f1.read_bytes()[:-7])
    f2.write_bytes(serde.encode(ckey(9), chunk(9), codec))  # another key's valid value: foreign
    assert disk.get(ckey(0)) is None
    assert disk.batched_get([ckey(1), ckey(2)]) == [None, None]
    s = disk.stats()
    assert s.corrupt == 3 and s.hits == 0
    assert not f0.exists() and not f1.exists()  # bad values are dropped, not served again


def test_unwritable_directory_raises_backend_error(tmp_path: Path) -> None:
    root = tmp_path / "d"
    disk = DiskBackend(root)
    disk.put(ckey(0), chunk(0))
    shutil.rmtree(root)
    root.write_bytes(b"")  # the directory is gone and a file sits in its place: every write fails
    with pytest.raises(BackendError, match="cannot write"):
        disk.put(ckey(1), chunk(1))
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
    os.unlink(root)
    with pytest.raises(BackendError):
        DiskBackend(Path("/proc/kvtier-cannot-exist"))


def test_a_link_fifo_or_directory_at_a_chunk_name_is_a_miss_never_followed(tmp_path: Path) -> None:
    """Chunk files are opened and listed by the file-per-entry layer (kvstore/entry_files/): what
    is not a regular file is never read (a FIFO would block the read), followed or indexed."""
    root = tmp_path / "d"
    disk = DiskBackend(root)
    for i in range(4):
        disk.put(ckey(i), chunk(i))
    link, fifo, folder = (disk._path(ckey(i)) for i in range(3))
    link.rename(tmp_path / "elsewhere")
    link.symlink_to(tmp_path / "elsewhere")  # this key's own valid bytes, behind a link
    fifo.unlink()
    os.mkfifo(fifo)
    folder.unlink()
    folder.mkdir()
    assert disk.batched_get([ckey(i) for i in range(3)]) == [None, None, None]
    assert torch.equal(disk.get(ckey(3)), chunk(3))
    again = DiskBackend(root)
    assert again.stats().entries == 1 and again.batched_contains([ckey(i) for i in range(4)]) == [False] * 3 + [True]
    # listed by key prefix (a tenant's files), the same: never counted, deleted or followed
    assert keys_with_prefix(root, ckey(0)[:4]) == [ckey(3)]
    assert again.delete_prefix(ckey(0)[:4]) == 1
    assert link.is_symlink() and fifo.exists() and folder.is_dir() and (tmp_path / "elsewhere").exists()
