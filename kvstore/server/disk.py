"""The cache server's disk spill: one file per entry, LRU within its own byte budget.

Values are opaque bytes. Each file holds a small header (magic, key length, value length,
CRC-32 of the value), the key and the value; it is written to a temporary name and renamed,
so a crash never leaves a half-written entry under a real name. A file that fails its
checks is deleted and reported as a miss. The budget counts whole file sizes.

The directory is a cache, never a reason to stop serving: entries that are not regular
files are skipped with a warning (never opened: a FIFO would block), and when it stops
accepting writes (read-only, full) the failure is logged and evicted entries are dropped.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import stat
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from kvstore.server.protocol import Buffer, empty_buffer

log = logging.getLogger(__name__)

_MAGIC = b"KVSD"
# magic, key length, value length, crc32(value)
_HEAD = struct.Struct("<4sIQI")
_SUFFIX = ".kvs"
_TMP_SUFFIX = ".tmp"


def _file_name(key: bytes) -> str:
    # Keys are arbitrary bytes: name files by a digest; the key itself is stored inside.
    return hashlib.sha256(key).hexdigest() + _SUFFIX


class DiskSpill:
    """Entries evicted from memory, kept on disk until their own LRU evicts them.

    Not thread-safe: the server calls it only from its event loop thread.
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_disk_bytes must be positive, got {max_bytes}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.bytes_used = 0
        self.evictions = 0
        self.corrupt = 0
        self.write_failures = 0
        self._failing = False  # the last write or removal failed (logged once per episode)
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, LRU first
        self._load_index()

    def _load_index(self) -> None:
        """Rebuilds the index from the directory (oldest mtime = least recently used)."""
        found: list[tuple[float, bytes, int, Path]] = []
        for path in self.dir.iterdir():
            if not path.name.endswith((_TMP_SUFFIX, _SUFFIX)):
                continue
            try:
                st = path.lstat()
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                log.warning("disk spill: skipping %s: not a regular file", path)
                continue
            if path.name.endswith(_TMP_SUFFIX):
                self._unlink(path)  # an interrupted write
                continue
            try:
                with _open_regular(path) as f:
                    head = f.read(_HEAD.size)
                    magic, key_len, value_len, _ = _HEAD.unpack(head)
                    key = f.read(key_len)
            except (OSError, struct.error):
                self._unlink(path)
                continue
            size = _HEAD.size + key_len + value_len
            if magic != _MAGIC or len(key) != key_len or st.st_size != size or path.name != _file_name(key):
                self._unlink(path)
                continue
            found.append((st.st_mtime, key, size, path))
        for _, key, size, _ in sorted(found, key=lambda t: t[0]):
            self._index[key] = size
            self.bytes_used += size
        self._evict_to(self.max_bytes)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def file_size(self, key: bytes) -> int:
        """Returns the size of `key`'s file (what `get` allocates to read it); 0 if absent."""
        return self._index.get(key, 0)

    def put(self, key: bytes, value: Buffer) -> bool:
        """Writes `value` under `key`, evicting LRU files first; returns False (and stores
        nothing) if the entry alone exceeds the disk budget or the write fails."""
        size = _HEAD.size + len(key) + len(value)
        self.delete(key)
        if size > self.max_bytes:
            return False
        self._evict_to(self.max_bytes - size)
        path = self.dir / _file_name(key)
        tmp = path.with_name(path.name + _TMP_SUFFIX)
        try:
            with open(tmp, "wb") as f:
                f.write(_HEAD.pack(_MAGIC, len(key), len(value), zlib.crc32(value)))
                f.write(key)
                f.write(value)
            os.replace(tmp, path)
        except OSError as exc:
            self._write_failed(exc)
            self._unlink(tmp)
            return False
        self._failing = False
        self._index[key] = size
        self.bytes_used += size
        return True

    def get(self, key: bytes) -> memoryview | None:
        """Returns the value stored under `key`, or None on a miss or a damaged file
        (which is deleted)."""
        size = self._index.get(key)
        if size is None:
            return None
        try:
            with _open_regular(self.dir / _file_name(key)) as f:
                value = self._read(f, key, size)
        except OSError:
            value = None
        if value is None:
            self.corrupt += 1
            self.delete(key)
            return None
        self._index.move_to_end(key)
        return value

    def pop(self, key: bytes, make_room: Callable[[int], None]) -> memoryview | None:
        """Removes `key` and returns its value, or None if absent or damaged. The file is
        unlinked before `make_room(file size)` runs, so what the caller spills to make room
        may use its disk space, and read after it, so the caller can commit memory first."""
        size = self._index.get(key)
        if size is None:
            return None
        try:
            f: io.FileIO | None = _open_regular(self.dir / _file_name(key))
        except OSError:
            f = None
        self.delete(key)
        value = None
        if f is not None:
            with f:
                make_room(size)
                try:
                    value = self._read(f, key, size)
                except OSError:
                    value = None
        if value is None:
            self.corrupt += 1
        return value

    @staticmethod
    def _read(f: io.FileIO, key: bytes, size: int) -> memoryview | None:
        """Returns the value of the open entry file `f` (a view of one buffer of the whole
        file), or None if it fails any check."""
        buf = empty_buffer(size)
        if f.readinto(buf) != size:
            return None
        magic, key_len, value_len, crc = _HEAD.unpack_from(buf)
        start = _HEAD.size + key_len
        value = buf[start:]
        if (magic == _MAGIC and key_len == len(key) and buf[_HEAD.size : start] == key
                and len(value) == value_len and zlib.crc32(value) == crc):
            return value
        return None

    def delete(self, key: bytes) -> bool:
        """Removes `key`; returns whether it was present."""
        size = self._index.pop(key, None)
        if size is None:
            return False
        self.bytes_used -= size
        self._unlink(self.dir / _file_name(key))
        return True

    def clear(self) -> None:
        for key in list(self._index):
            self.delete(key)

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            self._write_failed(exc)

    def _write_failed(self, exc: OSError) -> None:
        """Counts a failed write or removal; logs the first of a run of them, so a directory
        that turned read-only or full is reported once, not per entry."""
        self.write_failures += 1
        if not self._failing:
            self._failing = True
            log.error("disk spill %s stopped accepting writes (%s): evicted entries are dropped, "
                      "memory keeps serving", self.dir, exc)

    def _evict_to(self, limit: int) -> None:
        while self.bytes_used > limit and self._index:
            key = next(iter(self._index))
            self.delete(key)
            self.evictions += 1


def _open_regular(path: Path) -> io.FileIO:
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
