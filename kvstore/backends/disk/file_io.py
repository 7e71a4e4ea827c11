"""Reading one chunk file's bytes (their layout: file_format.py), checked as they arrive, into
a pooled buffer or straight into the caller's memory (`Destination`). The reads themselves are
the file-per-entry layer's (kvstore/entry_files/entry_reads.py, which the cache server's spill
reads through too, as it writes through its atomic_write.py); what is the disk tier's own stays
here: its values are serde values, checked by serde, and read in place into K/V blocks.

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
from kvstore.entry_files.entry_reads import MAX_VIEWS, read_into, read_pieces
from kvstore.read_buffers import ReadBufferPool


def read_value(fd: int, key: str, pool: ReadBufferPool) -> serde.CheckedValue:
    """Returns the value in file `fd`, stored under `key`, in a buffer taken from `pool`,
    with its check fed as it was read (a short file gives a short value; decoding refuses it).
    The whole file is read to the buffer's start, so the payload lands line-aligned."""
    size = os.fstat(fd).st_size
    buf = pool.take(size)
    check = serde.ValueCheck(key)
    end = start = 0
    for n, got in read_pieces(fd, buf, serde.CHECK_PIECE):
        if not n:
            start = value_start(buf[:got])  # the first piece holds HEAD_LEN bytes, or the whole file
        check.feed(buf[max(n, start):n + got])
        end = n + got
    return serde.CheckedValue(buf[start:end], check)


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
        expected = offset + sum(view.nbytes for view in piece)
        offset = read_into(fd, piece, offset)
        if offset != expected:
            raise serde.SerdeError("value truncated: the file ended inside its payload")
        for view in piece:
            check.feed(view)
    if offset != size:
        raise serde.SerdeError(f"file of {size} bytes, its value ends at {offset}")
    check.verify(offset - start)
    return True


def _pieces(views: Sequence[memoryview]) -> Iterator[list[memoryview]]:
    """Yields `views` (byte views) in order, in groups of at most serde.CHECK_PIECE bytes and
    MAX_VIEWS views; a longer view is split across groups."""
    group: list[memoryview] = []
    room = serde.CHECK_PIECE
    for view in views:
        while view.nbytes:
            part, view = view[:room], view[room:]
            group.append(part)
            room -= part.nbytes
            if not room or len(group) == MAX_VIEWS:
                yield group
                group, room = [], serde.CHECK_PIECE
    if group:
        yield group
