"""The cache server's disk spill: one file per entry, LRU within its own byte budget.

Values are opaque bytes. Each file holds a small header (magic, key length, value length,
CRC-32 of the value), the key and the value; it is written to a temporary name and renamed,
so a crash never leaves a half-written entry under a real name. A file that fails its
checks is deleted and reported as a miss. The budget counts whole file sizes.
"""

from __future__ import annotations

import hashlib
import os
import struct
import zlib
from collections import OrderedDict
from pathlib import Path

from kvstore.server.protocol import Buffer, empty_buffer

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
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, LRU first
        self._load_index()

    def _load_index(self) -> None:
        """Rebuilds the index from the directory (oldest mtime = least recently used)."""
        found: list[tuple[float, bytes, int, Path]] = []
        for path in self.dir.iterdir():
            if path.name.endswith(_TMP_SUFFIX):
                path.unlink(missing_ok=True)  # an interrupted write
                continue
            if not path.name.endswith(_SUFFIX):
                continue
            try:
                st = path.stat()
                with open(path, "rb") as f:
                    head = f.read(_HEAD.size)
                    magic, key_len, value_len, _ = _HEAD.unpack(head)
                    key = f.read(key_len)
            except (OSError, struct.error):
                path.unlink(missing_ok=True)
                continue
            size = _HEAD.size + key_len + value_len
            if magic != _MAGIC or len(key) != key_len or st.st_size != size or path.name != _file_name(key):
                path.unlink(missing_ok=True)
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

    def keys_lru_first(self) -> list[bytes]:
        return list(self._index)

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
        except OSError:
            tmp.unlink(missing_ok=True)
            return False
        self._index[key] = size
        self.bytes_used += size
        return True

    def get(self, key: bytes) -> memoryview | None:
        """Returns the value stored under `key`, or None on a miss or a damaged file
        (which is deleted)."""
        size = self._index.get(key)
        if size is None:
            return None
        path = self.dir / _file_name(key)
        buf = empty_buffer(size)
        try:
            with open(path, "rb", buffering=0) as f:
                n = f.readinto(buf)
        except OSError:
            n = -1
        if n == size:
            magic, key_len, value_len, crc = _HEAD.unpack_from(buf)
            start = _HEAD.size + key_len
            value = buf[start:]
            if (
                magic == _MAGIC
                and key_len == len(key)
                and buf[_HEAD.size : start] == key
                and len(value) == value_len
                and zlib.crc32(value) == crc
            ):
                self._index.move_to_end(key)
                return value
        self.corrupt += 1
        self.delete(key)
        return None

    def delete(self, key: bytes) -> bool:
        """Removes `key`; returns whether it was present."""
        size = self._index.pop(key, None)
        if size is None:
            return False
        self.bytes_used -= size
        (self.dir / _file_name(key)).unlink(missing_ok=True)
        return True

    def clear(self) -> None:
        for key in list(self._index):
            self.delete(key)

    def _evict_to(self, limit: int) -> None:
        while self.bytes_used > limit and self._index:
            key = next(iter(self._index))
            self.delete(key)
            self.evictions += 1
