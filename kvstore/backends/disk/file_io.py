"""Reading and writing one chunk file's bytes (their layout: file_format.py). A write fills
a temp file the tier has reserved room for; a read is checked as it arrives, into a pooled
buffer or straight into the caller's memory (`Destination`).

Each piece is hashed (`serde.ValueCheck`) right after it is read, while it is still in the
CPU's cache, instead of being read back from memory by a second pass. Reading in place skips
the buffer: the page cache is copied once, into the destination, instead of into a buffer
and then from it (benchmarks/bench_load.py, disk rows).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from kvstore import serde
from kvstore.backend import Destination
from kvstore.backends.disk.file_format import HEAD_LEN, value_start
from kvstore.codecs import Buffer
from kvstore.read_buffers import ReadBufferPool

_MAX_VIEWS = 1024  # IOV_MAX on Linux: the most buffers one preadv takes


def write_file(fd: int, parts: Sequence[Buffer], fsync: bool) -> None:
    """Writes `parts` (file_format.file_parts) in order to the new file `fd`, then closes it,
    fsync'd first if `fsync`. Raises OSError as the writes do; `fd` is closed either way."""
    with open(fd, "wb", buffering=0) as f:
        for part in parts:
            view = memoryview(part).cast("B")
            while view:  # raw writes may be short
                view = view[f.write(view):]
        if fsync:
            os.fsync(f.fileno())


def read_value(fd: int, key: str, pool: ReadBufferPool) -> serde.CheckedValue:
    """Returns the value in file `fd`, stored under `key`, in a buffer taken from `pool`,
    with its check fed as it was read (a short file gives a short value; decoding refuses it).
    The whole file is read to the buffer's start, so the payload lands line-aligned."""
    size = os.fstat(fd).st_size
    buf = pool.take(size)
    check = serde.ValueCheck(key)
    n = start = 0
    while n < size and (got := os.preadv(fd, [buf[n:n + serde.CHECK_PIECE]], n)):
        if not n:
            start = value_start(buf[:got])  # the first piece holds HEAD_LEN bytes, or the whole file
        check.feed(buf[max(n, start):n + got])
        n += got
    return serde.CheckedValue(buf[start:n], check)


def read_in_place(fd: int, key: str, dest: Destination) -> bool:
    """Reads the value in file `fd`, stored under `key`, straight into `dest`. Returns True
    once `dest` holds its payload, checked; False, with `dest` untouched, when the value is not
    raw `dest.dtype` of `dest.shape` (it cannot be read in place). Raises SerdeError for a
    corrupt, truncated or foreign value; `dest` may then hold anything."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, min(size, HEAD_LEN), 0)
    start = value_start(head)
    header = serde.read_header(head[start:])
    if header.codec != "raw" or header.dtype != dest.dtype or header.shape != tuple(dest.shape):
        return False
    if header.payload_len != dest.nbytes:
        raise serde.SerdeError(f"payload of {header.payload_len} bytes, {tuple(dest.shape)} takes {dest.nbytes}")
    check = serde.ValueCheck(key)
    check.feed(head[start:start + header.header_len])
    offset = start + header.header_len
    for piece in _pieces(dest.views):
        offset = _preadv_all(fd, piece, offset)
        for view in piece:
            check.feed(view)
    if offset != size:
        raise serde.SerdeError(f"file of {size} bytes, its value ends at {offset}")
    check.verify(offset - start)
    return True


def _pieces(views: Sequence[memoryview]) -> Iterator[list[memoryview]]:
    """Yields `views` (byte views) in order, in groups of at most serde.CHECK_PIECE bytes and
    _MAX_VIEWS views; a longer view is split across groups."""
    group: list[memoryview] = []
    room = serde.CHECK_PIECE
    for view in views:
        while view.nbytes:
            part, view = view[:room], view[room:]
            group.append(part)
            room -= part.nbytes
            if not room or len(group) == _MAX_VIEWS:
                yield group
                group, room = [], serde.CHECK_PIECE
    if group:
        yield group


def _preadv_all(fd: int, views: list[memoryview], offset: int) -> int:
    """Fills `views` from file `fd` at `offset`; returns the offset after them. Raises
    SerdeError if the file ends first."""
    while views:
        got = os.preadv(fd, views, offset)
        if got == 0:
            raise serde.SerdeError("value truncated: the file ended inside its payload")
        offset += got
        while views and got >= views[0].nbytes:
            got -= views[0].nbytes
            views = views[1:]
        if got:
            views = [views[0][got:], *views[1:]]
    return offset
