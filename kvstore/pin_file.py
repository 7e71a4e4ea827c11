"""A pin set's copy on disk (kvstore/pin_set.py), for the tiers whose operator pins survive a
restart and are seen by every process using their directory: the disk tier
(`<dir>/.kvtier-pins`, kvstore/backends/disk/) and the cache server's spill
(`<spill dir>/.kvtier-pins`, kvstore/cache_server/store.py).

One small JSON file (`PinSet.to_json`: a kind, a version, the pin budget, and per key its
bytes and its wall-clock expiry or null), replaced atomically (written and fsync'd under a
temp name, then renamed, by the file layer the disk tier and the spill write their entries
through: kvstore/entry_files/atomic_write.py), so a reader sees a whole file, the old one or
the new one. A reader
re-reads it only when it changed (its inode, mtime and size: one stat; each save sets an
mtime past the last one seen). A file that is not such
a pin set (corrupt, foreign, a later version, too large) is ignored with a warning, as holding
no pins, and replaced at the next change; it is parsed as JSON, never unpickled. Writers are
serialised by the caller (the disk tier writes under its directory's flock; the cache server
has one event loop).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from kvstore.entry_files.atomic_write import create_temp, discard, install, write_all
from kvstore.pin_set import PinSet

log = logging.getLogger(__name__)

PIN_FILE = ".kvtier-pins"
"""The pin file's name in the directory it belongs to."""
MAX_PIN_FILE_BYTES = 16 << 20
"""A larger file is not read (ignored with a warning): no pin set of a real tier is near it."""

_UNREAD = (-1, -1, -1)


class PinFile:
    """The pin file at `path`: `refresh` loads a PinSet from it when it changed, `save` replaces
    it. Not thread-safe: the owning tier calls it under its lock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = _UNREAD  # (inode, mtime_ns, size) last read or written; None: absent
        self._warned: tuple[int, int, int] | None = None

    @property
    def size(self) -> int:
        """Returns the file's size as last read or written (0: absent or never read)."""
        return 0 if self._seen is None or self._seen == _UNREAD else self._seen[2]

    def forget(self) -> None:
        """Makes the next `refresh` read the file whatever its stat says (changes made to the pin
        set since the last save are then dropped)."""
        self._seen = _UNREAD

    def refresh(self, pins: PinSet, exists: Callable[[str], bool] | None = None) -> bool:
        """Loads `pins` from the file when it changed since last read or written (one stat
        otherwise); returns whether `pins` was reloaded. A file gone, corrupt or foreign leaves
        `pins` with no pins (its budget kept); never raises for the file's content."""
        try:
            st = os.stat(self.path)
            sig: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            sig = None
        except OSError as exc:
            self._warn(_UNREAD, f"cannot stat it ({exc})")
            return False
        if sig == self._seen:
            return False
        data = self._read()
        if data is None:  # absent (or replaced by none meanwhile)
            self._seen = None
            pins.clear()
            return True
        sig, raw = data
        try:
            pins.load_json(raw, exists)
        except ValueError as exc:
            self._warn(sig, str(exc))
            pins.clear()
        self._seen = sig
        return True

    def _read(self) -> tuple[tuple[int, int, int], bytes] | None:
        """Returns (the file's signature, its bytes), or None when there is no file; an
        unreadable or oversized file reads as empty bytes (then ignored as not a pin set)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("pin file %s cannot be opened (%s): ignored, read as no pins", self.path, exc)
            return _UNREAD, b""
        try:
            st = os.fstat(fd)
            sig = (st.st_ino, st.st_mtime_ns, st.st_size)
            if st.st_size > MAX_PIN_FILE_BYTES:
                return sig, b"too large"
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return sig, b"".join(chunks)
        except OSError as exc:
            log.warning("pin file %s cannot be read (%s): ignored, read as no pins", self.path, exc)
            return _UNREAD, b""
        finally:
            os.close(fd)

    def save(self, pins: PinSet) -> int:
        """Replaces the file with `pins` (written and fsync'd under a temp name, then renamed);
        returns its new size. Raises OSError when it cannot be written (the old file stays)."""
        return self.write(pins.to_json())

    def write(self, data: bytes) -> int:
        """Replaces the file with `data` (a `PinSet.to_json`), as `save` does; returns its size."""
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        fd = create_temp(tmp, exclusive=False)  # this process's own name: a leftover is its crash's
        try:
            write_all(fd, [data])
            # mtimes strictly increase from one save to the next, so a coarse clock (or an inode
            # number reused) never makes a changed file look unchanged to a reader's stat
            last = self._seen[1] if self._seen is not None and self._seen != _UNREAD else 0
            stamp = max(time.time_ns(), last + 1)
            os.utime(fd, ns=(stamp, stamp))
            os.fsync(fd)
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            discard(tmp)
            raise
        os.close(fd)
        try:
            install(tmp, self.path)
        except OSError:
            discard(tmp)
            raise
        self._seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        return len(data)

    def _warn(self, sig: tuple[int, int, int], why: str) -> None:
        if sig != self._warned:  # once per version of the file
            self._warned = sig
            log.warning("pin file %s ignored (%s): read as no pins; it is replaced at the next pin change",
                        self.path, why)
