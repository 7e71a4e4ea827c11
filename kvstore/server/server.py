"""The asyncio cache server: one BufferedProtocol per connection over one ByteStore.

Small frames are parsed straight out of a per-connection 64 KiB receive buffer (many per
recv when clients pipeline); a frame larger than that is received directly into one
buffer of its exact size, which then becomes the stored value, so a PUT payload is
copied once from the socket and never again. Any framing error gets an error reply and
the connection is closed: the other clients never notice.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import socket
import ssl
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.server import protocol as P
from kvstore.server.heap import ResidentGuard
from kvstore.server.protocol import Op, Status
from kvstore.server.store import ByteStore

log = logging.getLogger(__name__)

_SCRATCH = 64 << 10
# Largest piece of a reply handed to the transport at once. asyncio copies what the kernel
# does not take into its own buffer, and the next piece waits until that buffer is empty: so
# a connection holds at most this much copied reply, whatever the value's size.
_SEND_SLICE = 256 << 10
# Over TLS a slice is also encrypted into OpenSSL's buffer and copied out of it: smaller.
_TLS_SEND_SLICE = 64 << 10
_INLINE_REPLY = 4096  # replies up to this size are sent as one copied piece
_OUT_MAX_ITEMS = 64  # queued reply pieces past which a connection's requests wait
# Resident bytes outside the budget (docs/protocol.md, "Memory bound"): per connection its
# receive buffer and one copied reply slice; for the process, allocator slack.
PER_CONNECTION_BYTES = _SCRATCH + _SEND_SLICE
# Over TLS (measured with stalled readers): asyncio's 256 KiB TLS read buffer, OpenSSL's
# buffers and up to three copies of a 64 KiB slice (plaintext, encrypted, unsent).
PER_TLS_CONNECTION_BYTES = 640 << 10
HEAP_SLACK_BYTES = 16 << 20
_EMPTY = b""
_OPS = frozenset(int(op) for op in Op)


@dataclass
class ServerConfig:
    """What `kvtier cache-server` takes besides the store's budgets."""

    host: str = "127.0.0.1"
    port: int = 65432
    max_payload: int = P.DEFAULT_MAX_PAYLOAD
    auth_token: str | None = None
    idle_timeout: float = 300.0  # a connection that sends nothing for this long is closed
    # Every frame must arrive whole (header and body) within this many seconds of its first
    # byte, and every reply piece must drain within it; also the TLS handshake's limit.
    frame_timeout: float = 30.0
    max_connections: int = 256
    tls_cert: str | None = None  # PEM certificate chain; with tls_key, clients must use TLS
    tls_key: str | None = None

    def validate(self) -> None:
        """Raises ValueError naming the first invalid field."""
        if self.max_payload <= 0:
            raise ValueError(f"max_payload must be positive, got {self.max_payload}")
        if self.idle_timeout <= 0:
            raise ValueError(f"idle_timeout must be positive, got {self.idle_timeout}")
        if self.frame_timeout <= 0:
            raise ValueError(f"frame_timeout must be positive, got {self.frame_timeout}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token must not be empty (leave it unset to disable auth)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")


def server_tls_context(cert: str, key: str) -> ssl.SSLContext:
    """Returns a TLS 1.2+ server context for `cert` (PEM chain) and `key`; raises ValueError
    naming the file when either cannot be loaded."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load TLS certificate {cert!r} with key {key!r}: {exc}") from exc
    return ctx


class CacheServer:
    """Serves one ByteStore over TCP (or TLS). Start with `await start()`; stop with `close()`."""

    def __init__(self, store: ByteStore, config: ServerConfig) -> None:
        config.validate()
        self.store = store
        self.config = config
        self._token = config.auth_token.encode() if config.auth_token is not None else None
        self._tls = None
        if config.tls_cert is not None and config.tls_key is not None:
            self._tls = server_tls_context(config.tls_cert, config.tls_key)
        self.max_payload = config.max_payload
        self.connections: set[_Connection] = set()
        # Connections whose next body waits for memory, oldest first.
        self.waiting: dict[_Connection, None] = {}
        self.total_connections = 0
        self.protocol_errors = 0
        self.refused_connections = 0
        self.frame_timeouts = 0
        self.busy_refusals = 0
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._wake_scheduled = False
        self.heap = ResidentGuard()

    def trim_heap(self, pending: int = 0) -> None:
        """Hands freed memory back to the OS when resident memory plus `pending` (a buffer
        about to be allocated) would pass the bound: the budget plus the allowance for the
        open connections and allocator slack (docs/protocol.md, "Memory bound")."""
        per_connection = PER_TLS_CONNECTION_BYTES if self._tls is not None else PER_CONNECTION_BYTES
        allowance = HEAP_SLACK_BYTES + len(self.connections) * per_connection
        self.heap.check(self.store.max_bytes + allowance, pending)

    async def start(self) -> tuple[str, int]:
        """Binds and starts accepting; returns the bound (host, port) (a free port for 0)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), self.config.host, self.config.port, reuse_address=True,
            ssl=self._tls, ssl_handshake_timeout=self.config.frame_timeout if self._tls else None,
        )
        self._sweeper = loop.call_later(self._sweep_period, self._sweep)
        self.heap.reset_baseline()
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    @property
    def _sweep_period(self) -> float:
        return min(1.0, self.config.frame_timeout / 4, self.config.idle_timeout / 4)

    def _sweep(self) -> None:
        # One timer for the whole server: deadlines are checked a few times per timeout.
        now = asyncio.get_running_loop().time()
        for conn in list(self.connections):
            conn.check_deadlines(now)
        self.memory_freed()  # a safety net: waiters retry at least once per sweep
        self.trim_heap()
        self._sweeper = asyncio.get_running_loop().call_later(self._sweep_period, self._sweep)

    def memory_freed(self) -> None:
        """Schedules a retry of the connections waiting for memory (once per loop turn)."""
        if self.waiting and not self._wake_scheduled:
            self._wake_scheduled = True
            asyncio.get_running_loop().call_soon(self._wake_waiters)

    def _wake_waiters(self) -> None:
        self._wake_scheduled = False
        for conn in list(self.waiting):
            self.waiting.pop(conn, None)
            conn.retry_admission()

    async def serve_until(self, stop: asyncio.Event) -> None:
        """Serves until `stop` is set, then closes every connection."""
        await stop.wait()
        await self.close()

    async def close(self) -> None:
        """Stops accepting and drops every connection (in-flight replies are abandoned)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._server is not None:
            self._server.close()
            for conn in list(self.connections):
                conn.abort()
            await self._server.wait_closed()
            self._server = None

    def check_token(self, token: bytes) -> bool:
        """Returns whether `token` is the configured one (constant-time comparison)."""
        assert self._token is not None
        return hmac.compare_digest(token, self._token)

    @property
    def auth_required(self) -> bool:
        return self._token is not None

    def stats_json(self) -> bytes:
        """Returns the STATS reply payload: store counters plus connection counters."""
        stats = self.store.stats().to_dict()
        stats["connections"] = len(self.connections)
        stats["total_connections"] = self.total_connections
        stats["protocol_errors"] = self.protocol_errors
        stats["refused_connections"] = self.refused_connections
        stats["frame_timeouts"] = self.frame_timeouts
        stats["busy_refusals"] = self.busy_refusals
        stats["waiting_for_memory"] = len(self.waiting)
        stats["heap_trims"] = self.heap.trims
        return json.dumps(stats).encode()


class _Connection(asyncio.BufferedProtocol):
    """Parses frames for one client and answers them in order."""

    def __init__(self, server: CacheServer) -> None:
        self.server = server
        self.store = server.store
        self.transport: asyncio.Transport | None = None
        self.authed = not server.auth_required
        self.closing = False
        self.scratch = bytearray(_SCRATCH)
        self.scratch_view = memoryview(self.scratch)  # never resized, so one view serves
        self.scratch_len = 0
        # Set while a frame too large for scratch is being received into its own buffer,
        # whose bytes are reserved in the store's budget until it is stored or dropped.
        self.big: memoryview | None = None
        self.big_header: P.Header | None = None
        self.big_filled = 0
        self.big_reserved = 0
        # Bytes of a refused frame's body still to be read and dropped.
        self.discard_left = 0
        # When the frame being received began (None: between frames); its deadline.
        self.frame_start: float | None = None
        self.waiting = False  # the next body waits for memory (reading paused)
        # Reply pieces not yet handed to the transport: (bytes, the stored value they are
        # part of, pinned in the store, or None for a copied piece).
        self.out: deque[tuple[P.Buffer, P.Buffer | None]] = deque()
        self.out_copied = 0
        self.write_blocked = False  # the transport holds unsent bytes
        self.slice = _SEND_SLICE
        self.reading_paused = False
        self.loop = asyncio.get_running_loop()
        self.last_active = self.send_progress = self.loop.time()

    # ---- asyncio callbacks ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        server = self.server
        if len(server.connections) >= server.config.max_connections:
            # Refuse in words rather than leave the client hanging, then close.
            self.closing = True
            server.refused_connections += 1
            limit = server.config.max_connections
            log.warning("refusing connection %s: --max-connections %d reached", self._peer(), limit)
            transport.write(P.encode_frame(Status.TOO_MANY_CONNECTIONS, 0,
                                           payload=f"too many connections (limit {limit})".encode()))
            if transport.can_write_eof():
                # Half-close and drop what the client already sent: closing with unread bytes
                # would reset the connection and could lose the refusal. Bounded: 1 s at most.
                transport.write_eof()
                self.loop.call_later(1.0, transport.abort)
            else:
                transport.close()
            return
        # Pause as soon as anything is left unsent: the next piece is written only once the
        # transport's (copying) buffer is empty. (high=1: TLS transports pause at >= high.)
        transport.set_write_buffer_limits(high=1, low=0)
        if transport.get_extra_info("sslcontext") is not None:
            self.slice = _TLS_SEND_SLICE
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        server.connections.add(self)
        server.total_connections += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        server = self.server
        if self not in server.connections:
            return  # refused at connect
        server.connections.discard(self)
        server.waiting.pop(self, None)
        freed = bool(self.big_reserved)
        self.store.release(self.big_reserved)
        self.big_reserved, self.big = 0, None
        while self.out:
            _, pinned = self.out.popleft()
            if pinned is not None:
                freed |= self.store.unpin(pinned)
        if freed:
            server.memory_freed()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.big is not None:
            return self.big[self.big_filled :]
        if self.closing:
            self.scratch_len = 0
        if self.discard_left:
            # Never read past the refused body: what follows is the next frame.
            return self.scratch_view[: min(self.discard_left, _SCRATCH)]
        return self.scratch_view[self.scratch_len :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.closing:
            return
        self.last_active = now = self.loop.time()
        if self.frame_start is None:
            self.frame_start = now
        if self.big is not None:
            self.big_filled += nbytes
            if self.big_filled == len(self.big):
                body, header, reserved = self.big, self.big_header, self.big_reserved
                self.big, self.big_header, self.big_reserved = None, None, 0
                self.frame_start = None
                assert header is not None
                self._dispatch(header, bytes(body[: header.key_len]), body[header.key_len :], reserved)
                if header.code != Op.PUT:  # the body was only read: its bytes go back
                    self.store.release(reserved)
                # Reserved bytes are now free or an evictable entry: waiters may fit.
                self.server.memory_freed()
            return
        if self.discard_left:
            self.discard_left -= nbytes
            if not self.discard_left:
                self.frame_start = None
            return
        self.scratch_len += nbytes
        self._parse_scratch()

    def pause_writing(self) -> None:
        self.write_blocked = True

    def resume_writing(self) -> None:
        self.write_blocked = False
        if self.closing or self.transport is None:
            return
        self._pump()
        self._parse_scratch()  # requests that waited for the replies to drain

    def eof_received(self) -> bool:
        return False  # close our side too

    def abort(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.abort()

    def check_deadlines(self, now: float) -> None:
        """Closes this connection if it idled, or a frame or reply overran its deadline
        (called by the server's sweep)."""
        if self.closing:
            return
        cfg = self.server.config
        if self.waiting and now - (self.frame_start or now) > cfg.frame_timeout:
            # Our side made it wait: tell it so, then close (its body cannot be skipped cheaply).
            self.server.busy_refusals += 1
            self.server.waiting.pop(self, None)
            self.waiting = False
            request_id = P.decode_header(self.scratch, self.server.max_payload).request_id
            self._fail(Status.BUSY, request_id, "server memory is held by other bodies in flight and "
                       f"replies being sent; waited {cfg.frame_timeout:g} s, retry later")
            return
        if now - self.last_active >= cfg.idle_timeout:
            reason = "idle"
        elif (self.frame_start is not None and not self.waiting and not self._backlogged()
              and now - self.frame_start > cfg.frame_timeout):
            reason = f"a frame not received whole within {cfg.frame_timeout:g} s"
        elif (self.out or self.write_blocked) and now - self.send_progress > cfg.frame_timeout:
            reason = f"a reply not read for {cfg.frame_timeout:g} s"
        else:
            return
        self.server.frame_timeouts += reason != "idle"
        log.info("closing connection %s: %s", self._peer(), reason)
        self.abort()

    def retry_admission(self) -> None:
        """Called when memory was freed: tries again to admit the waiting body."""
        self.waiting = False
        if not self.closing:
            self._parse_scratch()

    # ---- framing ----

    def _backlogged(self) -> bool:
        return len(self.out) >= _OUT_MAX_ITEMS or self.out_copied >= _SCRATCH

    def _update_reading(self) -> None:
        want_paused = self.waiting or self._backlogged()
        if want_paused != self.reading_paused and self.transport is not None and not self.closing:
            self.reading_paused = want_paused
            if want_paused:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    def _parse_scratch(self) -> None:
        buf, view, pos, end = self.scratch, self.scratch_view, 0, self.scratch_len
        framed = False
        while not self.closing and not self.waiting and not self._backlogged() and end - pos >= P.HEADER_SIZE:
            limit = self.server.max_payload if self.authed else _SCRATCH  # AUTH may precede
            try:
                header = P.decode_header(buf, limit, pos)
            except P.ProtocolError as exc:
                self._fail(Status.BAD_FRAME, 0, str(exc))
                return
            total = P.HEADER_SIZE + header.body_len
            refusal = self._refusal(header)
            if refusal is not None:
                # Well-framed but refused before its body is received: answer now and drop
                # the body as it arrives, so the connection stays usable.
                self._reply(refusal[0], header.request_id, refusal[1].encode())
                skip = min(total, end - pos)
                self.discard_left = total - skip
                pos += skip
                framed = True
                if self.discard_left:
                    break
                continue
            start = pos + P.HEADER_SIZE
            if end - pos >= total:
                key = bytes(view[start : start + header.key_len])
                payload = view[start + header.key_len : pos + total]
                pos += total
                framed = True
                if header.code == Op.PUT:
                    payload = memoryview(bytes(payload))  # scratch is reused: own the value
                self._dispatch(header, key, payload)
                continue
            if total > _SCRATCH:
                # Receive the body straight into its own buffer, once the budget admits it.
                if not self.store.reserve(header.body_len):
                    self.waiting = True
                    self.server.waiting[self] = None
                    break
                self.server.trim_heap(pending=header.body_len)  # after evicting, before allocating
                have = end - start
                self.frame_start = self.loop.time()  # any wait was ours: the body's deadline starts now
                self.big_reserved = header.body_len
                self.big = P.empty_buffer(header.body_len)
                self.big[:have] = view[start:end]  # copy what already arrived
                self.big_filled = have
                self.big_header = header
                pos = end
            break
        rest = end - pos
        if rest and pos:
            buf[:rest] = buf[pos:end]
        self.scratch_len = rest
        if not rest and self.big is None and not self.discard_left:
            self.frame_start = None  # between frames
        elif framed:
            self.frame_start = self.loop.time()  # what is left began with this read at the latest
        self._update_reading()

    def _refusal(self, h: P.Header) -> tuple[Status, str] | None:
        if not self.authed:
            return None  # handled (and the connection closed) by _dispatch
        if h.code not in _OPS:
            return Status.UNKNOWN_OP, f"unknown op {h.code}"
        if h.code == Op.PUT and not self.store.fits(h.key_len, h.payload_len):
            return Status.TOO_LARGE, f"entry of {h.body_len} bytes exceeds the server's memory budget"
        if h.code != Op.PUT and h.body_len > P.MAX_REQUEST_BODY:
            return (Status.TOO_LARGE,
                    f"request body of {h.body_len} bytes exceeds {P.MAX_REQUEST_BODY} (only PUT may be larger)")
        if P.HEADER_SIZE + h.body_len > _SCRATCH and not self.store.fits(0, h.body_len):
            return Status.TOO_LARGE, f"request body of {h.body_len} bytes exceeds the server's memory budget"
        return None

    def _fail(self, status: Status, request_id: int, message: str) -> None:
        """Sends an error reply and closes: after a framing error the stream cannot be trusted."""
        self.server.protocol_errors += status != Status.BUSY
        log.info("closing connection %s: %s", self._peer(), message)
        self._reply(status, request_id, message.encode())
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def _peer(self) -> object:
        return self.transport.get_extra_info("peername") if self.transport else None

    def _reply(self, status: int, request_id: int, payload: P.Buffer = _EMPTY, pinned: bool = False) -> None:
        """Queues one reply. A `pinned` payload (a stored value over _INLINE_REPLY bytes,
        pinned by the caller) is sent from the store's own buffer, never copied per
        connection, and unpinned once handed to the transport."""
        transport = self.transport
        if transport is None or transport.is_closing():
            if pinned and self.store.unpin(payload):
                self.server.memory_freed()
            return
        header = P.encode_header(status, request_id, 0, len(payload))
        if not pinned:
            piece = header + bytes(payload)
            self.out.append((piece, None))
            self.out_copied += len(piece)
        else:
            self.out.append((header, None))
            self.out_copied += len(header)
            self.out.append((payload, payload))
        self._pump()

    def _pump(self) -> None:
        """Hands queued reply pieces to the transport while it takes them without buffering,
        at most one slice (_SEND_SLICE, or _TLS_SEND_SLICE over TLS) at a time."""
        transport, out = self.transport, self.out
        if transport is None:
            return
        freed = False
        while out and not self.write_blocked and not self.closing:
            piece, pinned = out[0]
            self.send_progress = self.loop.time()
            if len(piece) > self.slice:
                view = memoryview(piece)
                out[0] = (view[self.slice :], pinned)
                transport.write(view[: self.slice])
                continue
            out.popleft()
            transport.write(piece)
            if pinned is None:
                self.out_copied -= len(piece)
            else:
                freed |= self.store.unpin(pinned)
        if freed:
            self.server.memory_freed()

    # ---- ops ----

    def _dispatch(self, h: P.Header, key: bytes, payload: memoryview, reserved: int = 0) -> None:
        """Runs one request. `reserved`: budget bytes held by this PUT's body buffer, which
        the store takes over (the caller releases them for any other op)."""
        rid = h.request_id
        if not self.authed:
            if h.code != Op.AUTH:
                self._fail(Status.AUTH_REQUIRED, rid, "authentication required: send AUTH first")
            elif not self.server.check_token(bytes(payload)):
                self._fail(Status.AUTH_FAILED, rid, "wrong auth token")
            else:
                self.authed = True
                self._reply(Status.OK, rid)
            return
        store = self.store
        code = h.code
        if code == Op.GET:
            value = store.get(key)
            if value is None:
                self._reply(Status.NOT_FOUND, rid)
            elif len(value) <= _INLINE_REPLY:
                self._reply(Status.OK, rid, value)
            else:
                store.pin(key, value)
                self._reply(Status.OK, rid, value, pinned=True)
        elif code == Op.EXISTS:
            self._reply(Status.OK if store.contains(key) else Status.NOT_FOUND, rid)
        elif code == Op.PREFIX_HITS:
            try:
                keys = P.decode_key_list(payload, P.MAX_KEYS_PER_REQUEST)
            except P.ProtocolError as exc:
                self._reply(Status.BAD_REQUEST, rid, str(exc).encode())
                return
            self._reply(Status.OK, rid, P.encode_count(store.prefix_hits(keys)))
        elif code == Op.PUT:
            if store.put(key, payload, reserved):
                self._reply(Status.OK, rid)
            elif not store.fits(len(key), len(payload)):
                self._reply(Status.TOO_LARGE, rid, b"entry exceeds the server's memory budget")
            else:
                self.server.busy_refusals += 1
                self._reply(Status.BUSY, rid, b"no memory free for this entry now: replies being sent "
                            b"and bodies in flight hold it; retry later")
        elif code == Op.DELETE:
            self._reply(Status.OK if store.delete(key) else Status.NOT_FOUND, rid)
        elif code == Op.PING:
            self._reply(Status.OK, rid, b"PONG")
        elif code == Op.CLEAR:
            store.clear()
            self._reply(Status.OK, rid)
        elif code == Op.STATS:
            self._reply(Status.OK, rid, self.server.stats_json())
        elif code == Op.AUTH:
            # Already authenticated (or auth disabled): a correct token is a no-op.
            if not self.server.auth_required or self.server.check_token(bytes(payload)):
                self._reply(Status.OK, rid)
            else:  # a wrong token is a wrong token, whenever it comes: close
                self._fail(Status.AUTH_FAILED, rid, "wrong auth token")
        else:  # unreachable: unknown ops are refused while framing
            self._reply(Status.UNKNOWN_OP, rid, f"unknown op {code}".encode())


async def serve(
    store: ByteStore,
    config: ServerConfig,
    *,
    on_listening: Callable[[str, int], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Runs the server until SIGINT/SIGTERM (or `stop` is set), then closes every
    connection and, when the store has a disk spill, writes memory to disk so that a
    restart with the same directory keeps the data."""
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    server = CacheServer(store, config)
    host, port = await server.start()
    installed: list[signal.Signals] = []
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        if on_listening is not None:
            on_listening(host, port)
        await server.serve_until(stop)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        await server.close()
        store.flush_to_disk()
