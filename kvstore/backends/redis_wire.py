"""The redis tier's wire helpers: a RESP packer that sends a chunk's header and payload
without joining them, and a reader of pipelined GET replies straight into fresh buffers,
checked as they arrive (kvstore/backends/redis_store.py: the packer on a single node, the
reader on every node of a cluster too)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import redis
import redis.cluster
from redis._parsers.encoders import Encoder
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from kvstore import serde
from kvstore.codecs import Buffer

# Error replies that say the key lives elsewhere (or will shortly): fetched again, not refused.
_REDIRECTS = frozenset({"MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN"})


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


def read_bulk_replies(sock: Any, keys: Sequence[str]) -> list[serde.CheckedValue | Buffer | ResponseError | None]:
    """Returns the RESP bulk-string replies to GETs of `keys` (None for a null, a ResponseError
    for a key's error reply such as WRONGTYPE or MOVED) read from `sock`, each received straight into
    its own numpy-allocated (huge-page) buffer and checked as it arrives (`serde.ValueCheck`
    for its key, fed piece by piece, so decoding does not read it again): hiredis grows one
    buffer and copies every value out of it, and fresh small-page buffers fault on every
    4 KiB. Raises ReplyError / OSError; the caller then drops the connection, since the
    stream position is lost."""
    pending = bytearray()  # received, not yet consumed: reply headers and value tails
    out: list[serde.CheckedValue | Buffer | ResponseError | None] = []
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
        if line[:1] == b"-":  # an error reply (WRONGTYPE, MOVED): this key only; the stream is intact
            out.append(ResponseError(line[1:].decode(errors="replace")))
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


def get_pipelined(client: redis.Redis, keys: Sequence[str]) -> list[serde.CheckedValue | Buffer | ResponseError | None]:
    """Returns the replies to GETs of `keys` sent pipelined on one of `client`'s pooled
    connections, read by `read_bulk_replies` (a connection that failed mid-way is dropped)."""
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_packed_command(conn.pack_commands([("GET", k) for k in keys]))
        sock = conn._get_socket()
        if sock is None:
            raise OSError("no socket after sending")
        return read_bulk_replies(sock, keys)
    except BaseException:
        conn.disconnect()  # its stream position is unknown: never reuse it
        raise
    finally:
        pool.release(conn)


def get_on_nodes(cluster: redis.cluster.RedisCluster, keys: Sequence[str]) -> tuple[list[Any], list[int]]:
    """Returns the replies to GETs of `keys`, pipelined per node of `cluster` as its slot map
    says (`get_pipelined`), and the indices of the keys to fetch again through redis-py: those
    whose node answered a redirection or failed, or whose slot the map does not cover. A
    timeout raises: the load's deadline has passed."""
    replies: list[Any] = [None] * len(keys)
    again: list[int] = []
    by_node: dict[str, tuple[redis.Redis, list[int]]] = {}
    for i, key in enumerate(keys):
        try:
            node = cluster.get_node_from_key(key)
        except RedisClusterException:
            again.append(i)
            continue
        if node.name not in by_node:
            by_node[node.name] = (cluster.get_redis_connection(node), [])
        by_node[node.name][1].append(i)
    for client, wanted in by_node.values():
        try:
            got = get_pipelined(client, [keys[i] for i in wanted])
        except (TimeoutError, redis.TimeoutError):
            raise
        except (RedisError, OSError):
            again.extend(wanted)
            continue
        for i, reply in zip(wanted, got):
            if isinstance(reply, ResponseError) and str(reply).split(" ", 1)[0] in _REDIRECTS:
                again.append(i)
            else:
                replies[i] = reply
    return replies, again
