"""The redis tier's wire helpers: a RESP packer that sends a chunk's header and payload
without joining them, and a reader of pipelined GET replies straight into fresh buffers,
checked as they arrive (kvstore/backends/redis_store.py uses both on its single-node fast
paths)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from redis._parsers.encoders import Encoder
from redis.exceptions import RedisError

from kvstore import serde
from kvstore.codecs import Buffer

NOT_A_CHUNK = b""
"""Stands for a key whose GET was an error reply (WRONGTYPE): it fails `serde.decode` like any
garbage, so the key is a miss, counted corrupt and removed."""


class SplitValuePacker:
    """RESP command packer that sends a `serde.SplitValue` as one bulk string written in two
    parts (header, then the payload memoryview straight from the tensor): no join, no copy.

    redis-py's default (hiredis) packer copies every argument into one new buffer; for
    multi-MB chunks that copy and its page faults cost as much as the socket write.
    """

    def __init__(self, buffer_cutoff: int = 6000) -> None:
        self._cutoff = buffer_cutoff
        self._encode = Encoder("utf-8", "strict", False).encode

    def pack(self, *args: Any) -> list[Any]:
        if isinstance(args[0], str):  # "CONFIG GET" style names go out as separate words
            args = tuple(args[0].encode().split()) + args[1:]
        out: list[Any] = []
        buff = b"*%d\r\n" % len(args)
        for arg in args:
            if isinstance(arg, serde.SplitValue):
                out.append(buff + b"$%d\r\n" % arg.nbytes + arg.header)
                out.append(arg.payload)
                buff = b"\r\n"
                continue
            data = self._encode(arg)
            if isinstance(data, memoryview) or len(data) > self._cutoff:
                out.append(buff + b"$%d\r\n" % len(data))
                out.append(data)
                buff = b"\r\n"
            else:
                buff += b"$%d\r\n%s\r\n" % (len(data), data)
        out.append(buff)
        return out


class ReplyError(RedisError):
    """Redis answered a GET with something that is neither a bulk string, a null nor an error."""


def read_bulk_replies(sock: Any, keys: Sequence[str]) -> list[serde.CheckedValue | Buffer | None]:
    """Returns the RESP bulk-string replies to GETs of `keys` (None for a null, `NOT_A_CHUNK`
    for a key's error reply such as WRONGTYPE) read from `sock`, each received straight into
    its own numpy-allocated (huge-page) buffer and checked as it arrives (`serde.ValueCheck`
    for its key, fed piece by piece, so decoding does not read it again): hiredis grows one
    buffer and copies every value out of it, and fresh small-page buffers fault on every
    4 KiB. Raises ReplyError / OSError; the caller then drops the connection, since the
    stream position is lost."""
    pending = bytearray()  # received, not yet consumed: reply headers and value tails
    out: list[serde.CheckedValue | Buffer | None] = []
    for key in keys:
        while (eol := pending.find(b"\r\n")) < 0:
            chunk = sock.recv(1 << 16)
            if not chunk:
                raise OSError("connection closed mid-reply")
            pending += chunk
        line = bytes(pending[:eol])
        del pending[: eol + 2]
        if line == b"_" or line == b"$-1":  # RESP3 / RESP2 null: a missing key
            out.append(None)
            continue
        if line[:1] == b"-":  # an error reply (WRONGTYPE): this key only; the stream is intact
            out.append(NOT_A_CHUNK)
            continue
        if line[:1] != b"$" or not line[1:].isdigit():
            raise ReplyError(f"unexpected reply to GET: {line[:80]!r}")
        n = int(line[1:])
        value = np.empty(n + 2, dtype=np.uint8).data  # the value and its CRLF
        have = min(len(pending), n + 2)
        value[:have] = pending[:have]
        del pending[:have]
        check = serde.ValueCheck(key)
        while True:
            check.arrived(value[:n], min(have, n))
            if have == n + 2:
                break
            got = sock.recv_into(value[have:], min(n + 2 - have, serde.CHECK_PIECE))
            if not got:
                raise OSError("connection closed mid-value")
            have += got
        if value[n:] != b"\r\n":
            raise ReplyError("bulk reply not terminated by CRLF")
        out.append(serde.CheckedValue(value[:n], check))
    if pending:
        raise ReplyError("unexpected bytes after the GET replies")
    return out
