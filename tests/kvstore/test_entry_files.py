"""The file-per-entry layer (kvstore/entry_files/), tested once, directly: atomic writes and
their temp files, reads that never follow a link nor block on a FIFO and read a short file
short, directory scans that skip what is not a regular file and sweep stray temp files; and,
through it, both owners' formats (the disk tier's serde values, the spill's CRC frames): a
corrupted, truncated or foreign file is a miss, never wrong bytes."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvstore import serde
from kvstore.backends.disk.file_format import file_parts
from kvstore.backends.disk.file_io import read_value
from kvstore.cache_server import spillfile
from kvstore.entry_files.atomic_write import create_temp, write_atomically, write_parts
from kvstore.entry_files.entry_names import digest_name, quoted_key, quoted_name, quoted_prefix, temp_beside
from kvstore.entry_files.entry_reads import NotRegularFile, open_regular, read_into, read_pieces, regular_size
from kvstore.entry_files.entry_scan import names, scan
from kvstore.read_buffers import ReadBufferPool


def _read_all(path: Path, size: int | None = None, piece: int = 7) -> bytes:
    fd = open_regular(path)
    try:
        buf = memoryview(bytearray(os.fstat(fd).st_size if size is None else size))
        got = [(n, k) for n, k in read_pieces(fd, buf, piece)]
        assert [n for n, _ in got] == [sum(k for _, k in got[:i]) for i in range(len(got))]  # in order, no gap
        return bytes(buf[:sum(k for _, k in got)])
    finally:
        os.close(fd)


# -- names ----------------------------------------------------------------------------------
def test_names_round_trip_and_refuse_what_no_file_system_takes() -> None:
    key = "m/v1@tenant:a b%/é"
    name = quoted_name(key, ".kvc")
    assert "/" not in name and quoted_key(name, ".kvc") == key and name.startswith(quoted_prefix("m/v1@"))
    with pytest.raises(ValueError, match="too long"):
        quoted_name("k" * 300, ".kvc")
    assert digest_name(b"\x00/..", ".kvs") == digest_name(b"\x00/..", ".kvs") != digest_name(b"\x00/.", ".kvs")
    assert len(digest_name(b"x" * 10_000, ".kvs")) == 64 + 4
    assert temp_beside(Path("/d/a.kvs")) == Path("/d/a.kvs.tmp")


# -- writes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fsync", [False, True])
def test_an_atomic_write_leaves_the_whole_file_and_no_temp(tmp_path: Path, fsync: bool) -> None:
    path = tmp_path / "e.kvs"
    path.write_bytes(b"old")
    write_atomically(path, temp_beside(path), [b"head", bytearray(b"-"), memoryview(b"value" * 1000)], fsync)
    assert path.read_bytes() == b"head-" + b"value" * 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.kvs"]


def test_a_failed_write_removes_its_temp_and_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "e.kvs"
    target.mkdir()  # the rename cannot replace a directory
    (target / "inside").write_bytes(b"kept")
    with pytest.raises(OSError):
        write_atomically(target, temp_beside(target), [b"new"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.kvs"] and (target / "inside").read_bytes() == b"kept"


def test_temp_files_are_created_exclusively_or_reused_and_never_through_a_link(tmp_path: Path) -> None:
    tmp = tmp_path / "e.kvs.tmp"
    tmp.write_bytes(b"an interrupted write, longer than the next")
    with pytest.raises(FileExistsError):
        create_temp(tmp)  # a writer whose temp names are unique never meets one
    write_parts(create_temp(tmp, exclusive=False), [b"short"], fsync=False)
    assert tmp.read_bytes() == b"short"  # truncated and reused
    tmp.unlink()
    victim = tmp_path / "elsewhere"
    victim.write_bytes(b"not ours")
    tmp.symlink_to(victim)
    for exclusive in (True, False):
        with pytest.raises(OSError):
            create_temp(tmp, exclusive)
    assert victim.read_bytes() == b"not ours"


# -- reads ----------------------------------------------------------------------------------
def test_only_regular_files_are_opened(tmp_path: Path) -> None:
    regular = tmp_path / "regular"
    regular.write_bytes(b"bytes")
    (tmp_path / "link").symlink_to(regular)
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")  # no writer: a blocking open would never return
    assert _read_all(regular) == b"bytes" and regular_size(regular) == 5
    for name in ("link", "dir", "fifo"):
        with pytest.raises(NotRegularFile):
            os.close(open_regular(tmp_path / name))
        assert regular_size(tmp_path / name) is None
    with pytest.raises(FileNotFoundError):
        open_regular(tmp_path / "missing")
    assert regular_size(tmp_path / "missing") is None


def test_a_truncated_file_reads_short_never_padded(tmp_path: Path) -> None:
    path = tmp_path / "e"
    data = os.urandom(100)
    path.write_bytes(data[:61])
    assert _read_all(path, size=100) == data[:61]
    fd = open_regular(path)
    try:
        views = [memoryview(bytearray(40)), memoryview(bytearray(40))]
        assert read_into(fd, views, 10) == 61  # 51 of the 80 bytes asked for
        assert bytes(views[0]) == data[10:50] and bytes(views[1][:11]) == data[50:61]
        assert bytes(views[1][11:]) == bytes(29)  # the rest untouched
        whole = [memoryview(bytearray(30)), memoryview(bytearray(31))]
        assert read_into(fd, whole, 0) == 61 and b"".join(map(bytes, whole)) == data[:61]
    finally:
        os.close(fd)


# -- scans ----------------------------------------------------------------------------------
def test_a_scan_keeps_entries_sweeps_stray_temps_and_skips_what_is_not_a_regular_file(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for i, name in enumerate(("b.kvs", "a.kvs", "c.kvs")):
        (tmp_path / name).write_bytes(bytes(i + 1))
        os.utime(tmp_path / name, (1_000_000 + i, 1_000_000 + i))  # b oldest, not the first by name
    (tmp_path / "x.kvs.tmp").write_bytes(b"half a write")
    (tmp_path / "notes.txt").write_bytes(b"not ours")
    (tmp_path / "d.kvs").mkdir()
    os.mkfifo(tmp_path / "f.kvs")
    (tmp_path / "l.kvs").symlink_to(tmp_path / "a.kvs")
    (tmp_path / "t.kvs.tmp").mkdir()
    with caplog.at_level(logging.WARNING):
        found = scan(tmp_path, keep=lambda n: n.endswith(".kvs"), stray=lambda n: n.endswith(".tmp"), owner="test")
    assert [(f.name, f.size) for f in found] == [("b.kvs", 1), ("a.kvs", 2), ("c.kvs", 3)]
    assert not (tmp_path / "x.kvs.tmp").exists()  # swept
    assert all((tmp_path / n).exists() or (tmp_path / n).is_symlink() for n in ("notes.txt", "d.kvs", "f.kvs",
                                                                                  "l.kvs", "t.kvs.tmp"))
    skipped = sorted(r.getMessage().split("skipping ")[1] for r in caplog.records if "not a regular file" in r.message)
    assert skipped == [f"{tmp_path / n}: not a regular file" for n in ("d.kvs", "f.kvs", "l.kvs", "t.kvs.tmp")]


def test_names_lists_regular_files_only_silently_and_removes_nothing(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """`names`, the listing repeated as entries come and go (the disk tier's prefix listings):
    the regular files a filter keeps, nothing else (a link is not followed, a FIFO not
    opened), no warning each time, nothing removed."""
    for name in ("a.kvs", "b.kvs", "x.kvs.tmp", "notes.txt"):
        (tmp_path / name).write_bytes(b"1")
    (tmp_path / "d.kvs").mkdir()
    os.mkfifo(tmp_path / "f.kvs")
    (tmp_path / "l.kvs").symlink_to(tmp_path / "a.kvs")
    (tmp_path / "dangling.kvs").symlink_to(tmp_path / "gone")
    with caplog.at_level(logging.WARNING):
        assert sorted(names(tmp_path, lambda n: n.endswith(".kvs"))) == ["a.kvs", "b.kvs"]
        assert names(tmp_path, lambda n: n.endswith(".tmp")) == ["x.kvs.tmp"]
        assert names(tmp_path, lambda n: False) == []
    assert not caplog.records
    assert len(os.listdir(tmp_path)) == 8


# -- both owners' formats, read back through the layer ------------------------------------------
KEY = "chunk-7"
OTHER = "chunk-8"


def _disk_write(root: Path, key: str, kv: torch.Tensor) -> Path:
    path = root / quoted_name(key, ".kvc")
    write_atomically(path, root / ".tmp-test", file_parts(serde.encode_split(key, kv, "raw")))
    return path


def _disk_read(path: Path, key: str) -> torch.Tensor | None:
    """Reads as the disk tier does: what is not a regular file, or does not decode, is a miss."""
    try:
        fd = open_regular(path)
    except NotRegularFile:
        return None
    try:
        value = read_value(fd, key, ReadBufferPool())
    finally:
        os.close(fd)
    try:
        return serde.decode(key, value)
    except serde.SerdeError:
        return None


def _disk_case(root: Path) -> tuple[Path, Path, Callable[[Path], object | None], object]:
    kv = torch.arange(4 * 2 * 8 * 2 * 4, dtype=torch.float16).reshape(4, 2, 8, 2, 4)
    path, other = _disk_write(root, KEY, kv), _disk_write(root, OTHER, kv + 1)
    return path, other, lambda p: _disk_read(p, KEY), kv


def _spill_case(root: Path) -> tuple[Path, Path, Callable[[Path], object | None], object]:
    value = os.urandom(5000)
    path, other = root / spillfile.file_name(KEY.encode()), root / spillfile.file_name(OTHER.encode())
    spillfile.write(path, KEY.encode(), value)
    spillfile.write(other, OTHER.encode(), value)
    size = spillfile.file_size(len(KEY), len(value))

    def read(p: Path) -> bytes | None:
        got = spillfile.take(p, KEY.encode(), size)
        return None if got is None else bytes(got)
    return path, other, read, value


CASES = {"disk": _disk_case, "spill": _spill_case}


def _same(got: object, want: object) -> bool:
    return torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want


@pytest.mark.parametrize("owner", CASES)
@pytest.mark.parametrize("damage", ["none", "flipped", "truncated", "padded", "foreign", "link"])
def test_each_owner_reads_its_files_back_checked(tmp_path: Path, owner: str, damage: str) -> None:
    path, other, read, want = CASES[owner](tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "flipped":
        data[len(data) - 3] ^= 0x10  # a payload byte
        path.write_bytes(data)
    elif damage == "truncated":
        path.write_bytes(data[:-5])
    elif damage == "padded":
        path.write_bytes(data + b"\0" * 8)
    elif damage == "foreign":  # another key's whole, valid file under this key's name
        shutil.copyfile(other, path)
    elif damage == "link":  # a link to this very file's bytes: still never followed
        keep = tmp_path / "kept"
        path.rename(keep)
        path.symlink_to(keep)
    got = read(path)
    if damage == "none":
        assert _same(got, want)
    elif damage == "padded" and owner == "spill":  # its frame says the value's length: bytes past it are not read
        assert got is None or _same(got, want)  # (and a scan drops the file: its size is not the frame's)
    else:
        assert got is None
