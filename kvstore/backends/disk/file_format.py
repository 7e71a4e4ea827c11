"""The bytes of a chunk file, the one owner of its layout: a file header, zeros, then the
stored value (`serde`), placed so that the value's payload starts at a multiple of
PAYLOAD_ALIGN bytes.

Why: the kernel copies the page cache into memory at full speed only when source and
destination sit at the same offset within a cache line. The engine's blocks start on a line
and a 5-D chunk's payload starts 80 bytes into its value, so chunks read from files holding
just the value landed in the blocks markedly slower (measured in docs/results.md, "Loads
against this machine's floor"). The value itself is unchanged: the same bytes every tier
stores, checked the same way; the file header only says where it starts.

Files without the header (the value at offset 0, as written before it) are still read.
"""

from __future__ import annotations

import struct

from kvstore import serde
from kvstore.backend import StoredValue
from kvstore.codecs import Buffer

FILE_MAGIC = b"KVTF"
_FILE_HEADER = struct.Struct("<4sI")  # magic, offset of the value in the file
PAYLOAD_ALIGN = 64  # a cache line
HEAD_LEN = _FILE_HEADER.size + PAYLOAD_ALIGN + serde.MAX_HEADER_LEN
"""Bytes from a file's start that always hold both headers (or the whole of a shorter file)."""


def _file_prefix(header_len: int) -> bytes:
    """Returns what a file holds before a value whose header is `header_len` bytes long: the
    file header and zeros, so that the value's payload starts at a multiple of PAYLOAD_ALIGN."""
    start = _FILE_HEADER.size + (-(_FILE_HEADER.size + header_len)) % PAYLOAD_ALIGN
    return _FILE_HEADER.pack(FILE_MAGIC, start) + bytes(start - _FILE_HEADER.size)


def file_parts(value: StoredValue) -> list[Buffer]:
    """Returns what a file holding `value` is made of, in order: the file prefix, then the
    value (header and payload unjoined when `value` is a SplitValue). Raises SerdeError for
    a buffer that is not a stored value."""
    if isinstance(value, serde.SplitValue):
        return [_file_prefix(len(value.header)), value.header, value.payload]
    return [_file_prefix(serde.read_header(value).header_len), value]


def value_start(head: bytes | memoryview) -> int:
    """Returns where the value starts in a file whose first bytes are `head` (HEAD_LEN, or the
    whole file). A file without a valid file header gives 0: a value written before the header
    existed, or anything else, which decoding then refuses."""
    if len(head) >= _FILE_HEADER.size:
        magic, start = _FILE_HEADER.unpack_from(head, 0)
        if magic == FILE_MAGIC and _FILE_HEADER.size <= start < _FILE_HEADER.size + PAYLOAD_ALIGN:
            return start
    return 0
