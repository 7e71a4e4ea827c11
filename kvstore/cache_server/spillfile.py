"""The disk spill's files and directories: blocking I/O, run by the spill's worker thread
(and at startup), never on the event loop.

Layout: `DIR/gen-<n>/<sha256(key)>.kvs`. Each file holds a small header (magic, key length,
value length, CRC-32 of the value), the key and the value; it is written to a temporary
name and renamed, so a crash never leaves a half-written entry under a real name. CLEAR
starts generation n+1 and removes generation n in the background; at startup the newest
generation is reused and older ones (a removal a crash cut short) are removed.

Entries that are not regular files are skipped with a warning and never opened (a FIFO
would block); files are opened without following links.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from kvstore.cache_server.protocol import Buffer, empty_buffer

log = logging.getLogger(__name__)

MAGIC = b"KVSD"
# magic, key length, value length, crc32(value)
HEAD = struct.Struct("<4sIQI")
SUFFIX = ".kvs"
TMP_SUFFIX = ".tmp"
_GENERATION = re.compile(r"gen-(\d{1,18})")


def file_name(key: bytes) -> str:
    """Returns the file name of `key`'s entry (keys are arbitrary bytes: a digest names it;
    the key itself is stored inside)."""
    return hashlib.sha256(key).hexdigest() + SUFFIX


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

    def remove(target: Path, is_dir: bool) -> None:
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
            remove(Path(dirpath, name), False)
        for name in dirnames:  # links to directories are listed here: unlink them, never descend
            sub = Path(dirpath, name)
            remove(sub, not sub.is_symlink())
    remove(path, True)
    return failures


@dataclass
class Entry:
    """One valid entry file found by `scan`."""

    key: bytes
    size: int
    mtime: float


def scan(directory: Path) -> list[Entry]:
    """Returns the valid entries of `directory`, least recently used (oldest mtime) first.
    Removes interrupted writes and damaged files; skips, with a warning, what is not a
    regular file."""
    found: list[Entry] = []
    for path in directory.iterdir():
        if not path.name.endswith((TMP_SUFFIX, SUFFIX)):
            continue
        try:
            st = path.lstat()
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            log.warning("disk spill: skipping %s: not a regular file", path)
            continue
        if path.name.endswith(TMP_SUFFIX):
            unlink(path)  # an interrupted write
            continue
        try:
            with open_regular(path) as f:
                magic, key_len, value_len, _ = HEAD.unpack(f.read(HEAD.size))
                key = f.read(key_len)
        except (OSError, struct.error):
            unlink(path)
            continue
        size = file_size(key_len, value_len)
        if magic != MAGIC or len(key) != key_len or st.st_size != size or path.name != file_name(key):
            unlink(path)
            continue
        found.append(Entry(key, size, st.st_mtime))
    found.sort(key=lambda e: e.mtime)
    return found


def write(path: Path, key: bytes, value: Buffer) -> None:
    """Writes the entry file `path` (via a temporary name, renamed); raises OSError."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            f.write(HEAD.pack(MAGIC, len(key), len(value), zlib.crc32(value)))
            f.write(key)
            f.write(value)
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise


def take(path: Path, key: bytes, size: int) -> memoryview | None:
    """Reads and removes the entry file `path`; returns its value (a view of one buffer of
    the whole file, `size` bytes), or None if it is missing or fails any check."""
    try:
        f = open_regular(path)
    except OSError:
        return None
    with f:
        unlink(path)
        try:
            return _read(f, key, size)
        except OSError:
            return None


def _read(f: io.FileIO, key: bytes, size: int) -> memoryview | None:
    buf = empty_buffer(size)
    if f.readinto(buf) != size:
        return None
    magic, key_len, value_len, crc = HEAD.unpack_from(buf)
    start = HEAD.size + key_len
    value = buf[start:]
    if (magic == MAGIC and key_len == len(key) and buf[HEAD.size : start] == key
            and len(value) == value_len and zlib.crc32(value) == crc):
        return value
    return None


def unlink(path: Path) -> OSError | None:
    """Removes `path` if present; returns the error if that failed."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        return exc
    return None


def open_regular(path: Path) -> io.FileIO:
    """Returns `path` opened for binary reading; raises OSError unless it is a regular file
    (not following a symlink, and never blocking on a FIFO)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        return io.FileIO(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
