"""The disk spill's files and directories: blocking I/O, run by the spill's worker thread
(and at startup), never on the event loop.

Layout: `DIR/gen-<n>/<sha256(key)>.kvs`. Each file holds a small header (magic, key length,
value length, CRC-32 of the value), the key and the value: the spill's own format, because its
values are a client's opaque bytes, with no check of their own (the disk tier's are serde
values, checked by serde). CLEAR starts generation n+1 and removes generation n in the
background; at startup the newest generation is reused and older ones (a removal a crash cut
short) are removed.

Every entry file is named, written, opened and listed by the file-per-entry layer the disk tier
uses too (kvstore/entry_files/): written to `<name>.tmp` and renamed, so a crash never leaves a
half-written entry under a real name (a leftover temp file is removed at startup); entries that
are not regular files are skipped with a warning and never opened (a FIFO would block); links
are never followed. What stays here is the spill's own: its format and its check, the
generations, and `take` (a read that removes the file).
"""

from __future__ import annotations

import logging
import os
import re
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from kvstore.cache_server.protocol import Buffer, empty_buffer
from kvstore.entry_files import entry_scan
from kvstore.entry_files.atomic_write import write_atomically
from kvstore.entry_files.entry_names import TEMP_SUFFIX, digest_name, temp_beside
from kvstore.entry_files.entry_reads import open_regular, read_pieces
from kvstore.entry_files.entry_scan import remove

log = logging.getLogger(__name__)

MAGIC = b"KVSD"
# magic, key length, value length, crc32(value)
HEAD = struct.Struct("<4sIQI")
SUFFIX = ".kvs"
_GENERATION = re.compile(r"gen-(\d{1,18})")


def file_name(key: bytes) -> str:
    """Returns the file name of `key`'s entry (keys are arbitrary bytes: a digest names it;
    the key itself is stored inside)."""
    return digest_name(key, SUFFIX)


def file_size(key_len: int, value_len: int) -> int:
    """Returns the size of an entry file: what the disk budget counts."""
    return HEAD.size + key_len + value_len


def generation_dir(root: Path, n: int) -> Path:
    return root / f"gen-{n}"


def generations(root: Path) -> list[int]:
    """Returns the numbers of the generation directories under `root` (real directories,
    not links), oldest first."""
    found = []
    for path in root.iterdir():
        m = _GENERATION.fullmatch(path.name)
        if m is not None and stat.S_ISDIR(path.lstat().st_mode):
            found.append(int(m.group(1)))
    return sorted(found)


def remove_tree(path: Path) -> int:
    """Removes a retired generation directory, deepest entries first, never following
    links; returns how many entries could not be removed (the first failure is logged: a
    read-only directory keeps its files, which nothing reads any more)."""
    failures = 0

    def drop(target: Path, is_dir: bool) -> None:
        nonlocal failures
        try:
            if is_dir:
                target.rmdir()
            else:
                target.unlink(missing_ok=True)
        except OSError as exc:
            if not failures:
                log.warning("disk spill: cannot remove the cleared generation %s: %s", path, exc)
            failures += 1

    for dirpath, dirnames, filenames in os.walk(path, topdown=False):
        for name in filenames:
            drop(Path(dirpath, name), False)
        for name in dirnames:  # links to directories are listed here: unlink them, never descend
            sub = Path(dirpath, name)
            drop(sub, not sub.is_symlink())
    drop(path, True)
    return failures


@dataclass
class Entry:
    """One valid entry file found by `scan`."""

    key: bytes
    size: int
    mtime: float


def scan(directory: Path) -> list[Entry]:
    """Returns the valid entries of `directory`, least recently used (oldest mtime) first.
    Removes interrupted writes (temp files) and damaged files; skips, with a warning, what is
    not a regular file."""
    found: list[Entry] = []
    for f in entry_scan.scan(directory, keep=lambda name: name.endswith(SUFFIX),
                             stray=lambda name: name.endswith(TEMP_SUFFIX), owner="disk spill"):
        key = _key_of(f.path, f.size)
        if key is None:
            remove(f.path)
            continue
        found.append(Entry(key, f.size, f.mtime))
    return found


def _key_of(path: Path, size: int) -> bytes | None:
    """Returns the key in entry file `path` (`size` bytes, as listed) if its header is the
    spill's, says that size and its name is the key's; else None (the value is checked when read)."""
    try:
        fd = open_regular(path)
    except OSError:
        return None
    try:
        head = os.pread(fd, HEAD.size, 0)
        if len(head) != HEAD.size:
            return None
        magic, key_len, value_len, _ = HEAD.unpack(head)
        if magic != MAGIC or size != file_size(key_len, value_len):
            return None  # checked before the key is read: a foreign header's length is not allocated
        key = os.pread(fd, key_len, HEAD.size)
    except OSError:
        return None
    finally:
        os.close(fd)
    return key if len(key) == key_len and path.name == file_name(key) else None


def write(path: Path, key: bytes, value: Buffer) -> None:
    """Writes the entry file `path` (via its temp name, renamed); raises OSError. The spill is
    its directory's one writer: a temp file left at the name (an interrupted write's) is reused."""
    head = HEAD.pack(MAGIC, len(key), len(value), zlib.crc32(value))
    write_atomically(path, temp_beside(path), [head, key, value], exclusive=False)


def take(path: Path, key: bytes, size: int) -> memoryview | None:
    """Reads and removes the entry file `path`; returns its value (a view of one buffer of
    the whole file, `size` bytes), or None if it is missing or fails any check."""
    try:
        fd = open_regular(path)
    except OSError:
        return None
    try:
        remove(path)
        return _read(fd, key, size)
    except OSError:
        return None
    finally:
        os.close(fd)


def _read(fd: int, key: bytes, size: int) -> memoryview | None:
    buf = empty_buffer(size)
    if sum(got for _, got in read_pieces(fd, buf, max(size, 1))) != size:
        return None  # truncated
    magic, key_len, value_len, crc = HEAD.unpack_from(buf)
    start = HEAD.size + key_len
    value = buf[start:]
    if (magic == MAGIC and key_len == len(key) and buf[HEAD.size : start] == key
            and len(value) == value_len and zlib.crc32(value) == crc):
        return value
    return None
