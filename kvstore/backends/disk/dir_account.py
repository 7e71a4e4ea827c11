"""The directory's shared account, the one owner of its state file (`.kvtier-dir`: bytes
used, budget): read and written only under the file's exclusive flock, which every process
using the directory takes before changing anything in it (disk_tier.py)."""

from __future__ import annotations

import fcntl
import io
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

STATE_FILE = ".kvtier-dir"
"""The directory's shared accounting; holding its flock freezes every change to the directory."""
_STATE = struct.Struct("<8sqq")  # magic, bytes used (files + reserved temp files), budget (-1: none)
_STATE_MAGIC = b"KVTDIR01"
STATE_BYTES = _STATE.size
"""The state file's size: counted in the directory's budget like every file in it."""


@dataclass
class DirState:
    """The directory's account as read under the lock: bytes used (chunk files, live writers'
    reservations, the state file itself; -1 when it must be recounted) and budget (None: none)."""

    used: int
    budget: int | None


class DirAccount:
    """The state file of a directory: (bytes used, budget), read and written under its flock.
    Not thread-safe: the tier calls it under its own lock (flock is per open file, not thread)."""

    def __init__(self, root: Path) -> None:
        self.path = root / STATE_FILE
        self.file: io.FileIO | None = None
        self.why_read_only = ""
        self._open()

    def _open(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:  # read-only mount, another user's directory
            self.why_read_only = f"{type(exc).__name__}: {exc}"
            return
        self.file = io.FileIO(fd, "r+")  # closed with the tier, or when collected
        self._pid = os.getpid()

    @property
    def writable(self) -> bool:
        """Returns whether the state file could be opened for writing (else: why_read_only)."""
        return self.file is not None

    @contextmanager
    def locked(self, blocking: bool = True) -> Iterator[DirState]:
        """Yields the state under the exclusive lock and writes it back when the block ends.
        `blocking=False`: raises BlockingIOError at once if another process holds the lock."""
        assert self.file is not None
        if self._pid != os.getpid():  # a forked child shares the parent's open file, hence its lock
            self.file.close()
            self._open()
        fd = self.file.fileno()
        fcntl.flock(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            raw = os.pread(fd, _STATE.size, 0)
            if len(raw) == _STATE.size and raw[:8] == _STATE_MAGIC:
                _, used, budget = _STATE.unpack(raw)
                state = DirState(used, None if budget < 0 else budget)
            else:
                state = DirState(-1, None)  # fresh or foreign: the caller recounts
                os.ftruncate(fd, _STATE.size)
            yield state
            os.pwrite(fd, _STATE.pack(_STATE_MAGIC, state.used, -1 if state.budget is None else state.budget), 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Closes the state file (dropping any lock on it); idempotent."""
        if self.file is not None:
            self.file.close()
            self.file = None
