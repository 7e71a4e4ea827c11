"""A thread-safe, pooled, pipelining byte client for the cache server (docs/protocol.md).

Each call borrows one connection from a pool, sends its requests in windows of
`_WINDOW` (pipelined: one round trip per window, not per key), reads the replies in order
and returns the connection. A connection that breaks is dropped together with every idle
pooled one (a server restart kills them all); a call that failed on a reused connection is
retried once on a fresh one, which is safe because every op is idempotent.

Authenticated with a tenant token (`kvtier cache-server --tenant-tokens`), the connection may
touch only that tenant's keys: a GET, EXISTS, PUT or PREFIX_HITS the server refuses as outside
them (FORBIDDEN) is a miss or a value not stored, as for any key the server does not hold
(logged once per client); DELETE, DELETE_PREFIX and CLEAR raise ServerReplyError.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.backends.server_connection import (
    CLOSING,
    INLINE,
    ClientConnection,
    Observer,
    Payload,
    Reply,
    Request,
    ServerReplyError,
    ServerTimeout,
    ServerUnavailable,
)
from kvstore.cache_server import protocol as P
from kvstore.cache_server.protocol import Op, Status
from kvstore.deadlines import CACHE_SERVER_CLIENT_TIMEOUT_S, CACHE_SERVER_CONNECT_TIMEOUT_S

__all__ = ["CacheServerClient", "Observer", "Payload", "Reply", "Request", "ServerReplyError",
           "ServerTimeout", "ServerUnavailable"]

log = logging.getLogger(__name__)

# Requests in flight per connection. Small enough that unread replies can never fill the
# socket buffers both ways (which would deadlock a client that writes before it reads).
_WINDOW = 32


class CacheServerClient:
    """Byte-level client for `kvtier://host:port` (`tls`: a client SSLContext for a server
    started with --tls-cert, i.e. `kvtiers://`). Safe to share between threads.

    Raises ServerUnavailable when the server cannot be reached (the next call reconnects)
    and ServerReplyError when it refuses a request. Up to `pool_size` idle connections are
    kept; callers beyond that many at once open extra connections, closed after use.

    `timeout` (seconds without progress on a socket) defaults to the server's default
    --frame-timeout + 5 s: a live server answers every request within its frame timeout
    (BUSY, or a miss, at worst), so its answer wins and this timeout only catches a server
    that is stopped or unreachable. Against a server with a longer --frame-timeout, pass more.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        auth_token: str | None = None,
        connect_timeout: float = CACHE_SERVER_CONNECT_TIMEOUT_S,
        timeout: float = CACHE_SERVER_CLIENT_TIMEOUT_S,
        pool_size: int = 8,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        if not 0 < port <= 65535:
            raise ValueError(f"cache server port must be in 1..65535, got {port}")
        if connect_timeout <= 0 or timeout <= 0:
            raise ValueError("cache server timeouts must be positive")
        if pool_size < 1:
            raise ValueError(f"pool_size must be at least 1, got {pool_size}")
        self.host, self.port = host, port
        self._token = auth_token.encode() if auth_token else None
        self.connect_timeout, self.timeout = connect_timeout, timeout
        self.pool_size = pool_size
        self.tls = tls
        self._idle: list[ClientConnection] = []
        self._lock = threading.Lock()
        self._closed = False
        self.reconnects = 0
        self.forbidden = 0  # requests the server refused as outside this client's tenant token

    # ---- pool ----

    def _connect(self) -> ClientConnection:
        conn = ClientConnection(self.host, self.port, self.connect_timeout, self.timeout, self.tls)
        if self._token is not None:
            try:
                [rid] = conn.send([Request(Op.AUTH, payload=self._token)])
                reply = conn.recv(rid)
            except (OSError, ServerUnavailable) as exc:
                conn.close()
                raise ServerUnavailable(f"authentication with kvtier://{self.host}:{self.port} failed: {exc}") from exc
            if reply.status != Status.OK:
                conn.close()
                raise ServerReplyError(reply.status, bytes(reply.payload).decode(errors="replace"))
        return conn

    def _acquire(self) -> tuple[ClientConnection, bool]:
        with self._lock:
            if self._closed:
                raise ServerUnavailable("client is closed")
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def _release(self, conn: ClientConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.pool_size:
                self._idle.append(conn)
                return
        conn.close()

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def close(self) -> None:
        """Closes every pooled connection; later calls raise ServerUnavailable."""
        with self._lock:
            self._closed = True
        self._drop_idle()

    # ---- calls ----

    def call(self, requests: Sequence[Request],
             observers: Callable[[], Sequence[Observer | None]] | None = None) -> list[Reply]:
        """Returns one reply per request, in order, pipelined over one connection.
        `observers` gives one observer per request (or None), afresh for each attempt."""
        if not requests:
            return []
        conn, reused = self._acquire()
        try:
            replies = self._exchange(conn, requests, observers)
        except OSError as exc:  # ServerUnavailable and socket timeouts included
            self._drop_idle()
            if not reused or isinstance(exc, (ServerTimeout, socket.timeout)):
                raise _unavailable(exc) from exc
            # A stale pooled connection (server restarted or idle-closed): retry once, fresh.
            self.reconnects += 1
            conn = self._connect()
            try:
                replies = self._exchange(conn, requests, observers)
            except OSError as exc2:
                raise _unavailable(exc2) from exc2
        self._release(conn)
        return replies

    @staticmethod
    def _exchange(conn: ClientConnection, requests: Sequence[Request],
                  observers: Callable[[], Sequence[Observer | None]] | None) -> list[Reply]:
        """Returns the replies; closes `conn` on any failure (its stream is then unusable)."""
        try:
            return CacheServerClient._exchange_open(conn, requests, observers() if observers else None)
        except BaseException:
            conn.close()
            raise

    @staticmethod
    def _exchange_open(conn: ClientConnection, requests: Sequence[Request],
                       observers: Sequence[Observer | None] | None) -> list[Reply]:
        replies: list[Reply] = []
        for window in _windows(requests):
            ids = conn.send(window)
            for rid in ids:
                reply = conn.recv(rid, observers[len(replies)] if observers else None)
                if reply.status in CLOSING:
                    # The server closes the connection after these; surface them as refusals.
                    raise ServerReplyError(reply.status, bytes(reply.payload).decode(errors="replace"))
                replies.append(reply)
        return replies

    def _one(self, req: Request) -> Reply:
        return self.call([req])[0]

    def ping(self) -> bool:
        """Returns True if the server answered PING."""
        return self._one(Request(Op.PING)).status == Status.OK

    def put(self, key: bytes, value: Payload) -> bool:
        """Stores `value`; returns False if the server refused it as larger than its budget."""
        return self.put_many([(key, value)])[0]

    def put_many(self, items: Sequence[tuple[bytes, Payload]]) -> list[bool]:
        """Stores every item, pipelined; returns per item whether it was stored (False: too
        large for the server, or no memory free for it now). Other refusals raise
        ServerReplyError."""
        out: list[bool] = []
        replies = self.call([Request(Op.PUT, k, v) for k, v in items])
        self._count_forbidden(replies)
        for reply in replies:
            out.append(reply.status not in (Status.TOO_LARGE, Status.BUSY, Status.FORBIDDEN)
                       and _expect_ok(reply) is reply)
        return out

    def get(self, key: bytes) -> memoryview | None:
        """Returns the value, or None on a miss."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes],
                 observers: Callable[[], Sequence[Observer | None]] | None = None) -> list[memoryview | None]:
        """Returns one value or None per key, in order, pipelined (`observers` as in `call`)."""
        out: list[memoryview | None] = []
        replies = self.call([Request(Op.GET, k) for k in keys], observers)
        self._count_forbidden(replies)
        for reply in replies:
            out.append(None if reply.status in _MISS else _expect_ok(reply).payload)
        return out

    def exists(self, key: bytes) -> bool:
        return self.exists_many([key])[0]

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Returns whether each key is stored, pipelined."""
        replies = self.call([Request(Op.EXISTS, k) for k in keys])
        self._count_forbidden(replies)
        return [r.status not in _MISS and _expect_ok(r) is r for r in replies]

    def prefix_hits(self, keys: Sequence[bytes]) -> int:
        """Returns how many of `keys`, counted from the start, are stored: one round trip
        per MAX_KEYS_PER_REQUEST keys (the next only while every earlier key hit)."""
        total, step = 0, P.MAX_KEYS_PER_REQUEST
        for start in range(0, len(keys), step):
            part = keys[start : start + step]
            reply = self._one(Request(Op.PREFIX_HITS, payload=P.encode_key_list(part)))
            if reply.status == Status.FORBIDDEN:
                self._count_forbidden([reply])
                break
            hits = P.decode_count(_expect_ok(reply).payload)
            total += hits
            if hits < len(part):
                break
        return total

    def pin(self, keys: Sequence[bytes], ttl_s: float | None = None) -> int:
        """Pins `keys` on the server (all or none, for `ttl_s` seconds; None: until unpinned);
        returns the bytes newly pinned. ServerReplyError: PIN_REFUSED (nothing pinned: a key
        not held, or the server's pin budget), FORBIDDEN (a tenant token, another's keys)."""
        if len(keys) > P.MAX_KEYS_PER_REQUEST:
            raise ValueError(f"pin at most {P.MAX_KEYS_PER_REQUEST} keys at once (all or none)")
        return P.decode_count(_expect_ok(self._one(Request(Op.PIN, payload=P.encode_pin(ttl_s, keys)))).payload)

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Releases the server's pins of `keys`; returns how many were pinned."""
        total = 0
        for start in range(0, len(keys), P.MAX_KEYS_PER_REQUEST):
            part = keys[start : start + P.MAX_KEYS_PER_REQUEST]
            total += P.decode_count(_expect_ok(self._one(Request(Op.UNPIN, payload=P.encode_key_list(part)))).payload)
        return total

    def describe(self, keys: Sequence[bytes]) -> list[dict[str, Any] | None]:
        """Returns per key what the server holds of it (`bytes`, `pinned`, `pin_expires_in_s`),
        or None when it holds nothing under it."""
        out: list[dict[str, Any] | None] = []
        for start in range(0, len(keys), P.MAX_KEYS_PER_REQUEST):
            part = keys[start : start + P.MAX_KEYS_PER_REQUEST]
            reply = _expect_ok(self._one(Request(Op.DESCRIBE, payload=P.encode_key_list(part))))
            out += json.loads(bytes(reply.payload))
        return out

    def _count_forbidden(self, replies: Sequence[Reply]) -> None:
        refused = [r for r in replies if r.status == Status.FORBIDDEN]
        if not refused:
            return
        with self._lock:
            first = not self.forbidden
            self.forbidden += len(refused)
        if first:
            log.warning("kvtier://%s:%d: %s; such requests are answered as misses or not stored "
                        "(unsalted requests and other salts need the operator's token)",
                        self.host, self.port, bytes(refused[0].payload).decode(errors="replace"))

    def delete(self, key: bytes) -> bool:
        """Removes `key`; returns whether it was present."""
        return _found(self._one(Request(Op.DELETE, key)))

    def delete_prefix(self, prefix: bytes) -> int:
        """Removes every key starting with `prefix` (non-empty); returns how many."""
        return P.decode_count(_expect_ok(self._one(Request(Op.DELETE_PREFIX, prefix))).payload)

    def usage(self, prefix: bytes = b"") -> dict[tuple[str | None, str], tuple[int, int]]:
        """Returns per (tenant, key family) of the server's chunks under `prefix` (empty: all;
        a tenant token: its own prefix) their (entries, bytes)."""
        return P.decode_usage(_expect_ok(self._one(Request(Op.USAGE, prefix))).payload)

    def delete_idle(self, older_than_s: float) -> int:
        """Removes the server's chunks not used for `older_than_s` seconds (never pinned ones; the
        operator's token); returns how many."""
        ms = P.encode_count(max(0, round(older_than_s * 1000)))
        return P.decode_count(_expect_ok(self._one(Request(Op.DELETE_IDLE, payload=ms))).payload)

    def clear(self) -> None:
        _expect_ok(self._one(Request(Op.CLEAR)))

    def stats(self) -> dict[str, int]:
        """Returns the server's STATS counters (entries, bytes, hits, misses, evictions, ...)."""
        return json.loads(bytes(_expect_ok(self._one(Request(Op.STATS))).payload))

    def set_budget(self, max_bytes: int | None = None, tenant_quota: int | None = None) -> dict[str, int]:
        """Returns the server's STATS once it met the memory budget and/or tenant quota given (None:
        unchanged; the operator's token); ServerReplyError (FORBIDDEN, BAD_REQUEST) when refused."""
        reply = self._one(Request(Op.SET_BUDGET, payload=P.encode_limits(max_bytes, tenant_quota)))
        return json.loads(bytes(_expect_ok(reply).payload))


def _windows(requests: Sequence[Request]) -> list[Sequence[Request]]:
    """Returns the requests cut into pipelined windows of at most _WINDOW. A large payload
    never follows a request whose reply may be large (GET, STATS) in the same window: the
    server stops reading while such a reply is unread, so sending the payload first would
    wait for a reader that waits for us."""
    if len(requests) == 1:
        return [requests]
    out: list[Sequence[Request]] = []
    start, big_reply_pending = 0, False
    for i, req in enumerate(requests):
        if i > start and (i - start == _WINDOW or (big_reply_pending and req.payload_len > INLINE)):
            out.append(requests[start:i])
            start, big_reply_pending = i, False
        big_reply_pending = big_reply_pending or req.op in (Op.GET, Op.STATS)
    if start < len(requests):
        out.append(requests[start:])
    return out


_MISS = (Status.NOT_FOUND, Status.FORBIDDEN)  # a key outside a tenant token's tenant reads as absent


def _expect_ok(reply: Reply) -> Reply:
    if reply.status != Status.OK:
        raise ServerReplyError(reply.status, bytes(reply.payload).decode(errors="replace"))
    return reply


def _found(reply: Reply) -> bool:
    if reply.status == Status.NOT_FOUND:
        return False
    _expect_ok(reply)
    return True


def _unavailable(exc: BaseException) -> ServerUnavailable:
    return exc if isinstance(exc, ServerUnavailable) else ServerUnavailable(f"cache server I/O failed: {exc}")
