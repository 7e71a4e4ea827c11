"""Reading an entry file: opened only if it is a regular file, then read in pieces its owner
checks as they arrive (each piece hashed while still in the CPU's cache, not read back from
memory by a second pass), or straight into the owner's memory.

Nothing here decides whether bytes are good: the owner's format does (file_io.py of the disk
tier, spillfile.py of the cache server). What this layer promises is that a link, a FIFO, a
directory or a device is never read as an entry (`NotRegularFile`), and that a file that ends
early reads short, so its owner sees it truncated rather than padded.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

MAX_VIEWS = 1024
"""IOV_MAX on Linux: the most buffers one preadv takes."""


class NotRegularFile(OSError):
    """The entry's name holds something other than a regular file (a link, FIFO, directory)."""


def open_regular(path: Path) -> int:
    """Returns a descriptor of `path` opened for reading. Raises NotRegularFile unless it is a
    regular file (a link is not followed; a FIFO is opened without blocking, then refused),
    FileNotFoundError if there is none, OSError as os.open does."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise NotRegularFile(errno.ELOOP, "a link, not a regular file", str(path)) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def regular_size(path: Path) -> int | None:
    """Returns the size of `path` if it is a regular file (not following a link), None if there
    is none or it is something else; raises OSError when it cannot be looked at."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def read_pieces(fd: int, buf: memoryview, piece: int) -> Iterator[tuple[int, int]]:
    """Fills `buf` from the start of file `fd`, `piece` bytes at a time; yields (offset, bytes)
    as each piece arrives, for the caller to check it while it is in cache. Stops when `buf` is
    full or the file ends (then the offsets yielded add up to less than len(buf))."""
    n, size = 0, len(buf)
    while n < size and (got := os.preadv(fd, [buf[n:n + piece]], n)):
        yield n, got
        n += got


def read_into(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """Fills `views` (at most MAX_VIEWS byte views), in order, from file `fd` at `offset`;
    returns the offset after the last byte read: short of the views' total when the file ends
    first (what arrived is in the views; the rest is untouched)."""
    pending = list(views)
    while pending:
        got = os.preadv(fd, pending, offset)
        if got == 0:
            break
        offset += got
        while pending and got >= pending[0].nbytes:
            got -= pending[0].nbytes
            pending.pop(0)
        if got:
            pending[0] = pending[0][got:]
    return offset
