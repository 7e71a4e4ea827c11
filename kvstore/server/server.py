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
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.server import protocol as P
from kvstore.server.protocol import Op, Status
from kvstore.server.store import ByteStore

log = logging.getLogger(__name__)

_SCRATCH = 64 << 10
_WRITE_HIGH = 1 << 20  # unsent reply bytes above which a connection stops being served
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


class CacheServer:
    """Serves one ByteStore over TCP. Start with `await start()`; stop with `close()`."""

    def __init__(self, store: ByteStore, config: ServerConfig) -> None:
        if config.max_payload <= 0:
            raise ValueError(f"max_payload must be positive, got {config.max_payload}")
        if config.idle_timeout <= 0:
            raise ValueError(f"idle_timeout must be positive, got {config.idle_timeout}")
        if config.auth_token is not None and not config.auth_token:
            raise ValueError("auth_token must not be empty (leave it unset to disable auth)")
        self.store = store
        self.config = config
        self._token = config.auth_token.encode() if config.auth_token is not None else None
        self.max_payload = config.max_payload
        self.connections: set[_Connection] = set()
        self.total_connections = 0
        self.protocol_errors = 0
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> tuple[str, int]:
        """Binds and starts accepting; returns the bound (host, port) (a free port for 0)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), self.config.host, self.config.port, reuse_address=True
        )
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    async def serve_until(self, stop: asyncio.Event) -> None:
        """Serves until `stop` is set, then closes every connection."""
        await stop.wait()
        await self.close()

    async def close(self) -> None:
        """Stops accepting and drops every connection (in-flight replies are abandoned)."""
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
        return json.dumps(stats).encode()


class _Connection(asyncio.BufferedProtocol):
    """Parses frames for one client and answers them in order."""

    def __init__(self, server: CacheServer) -> None:
        self.server = server
        self.store = server.store
        self.transport: asyncio.Transport | None = None
        self.authed = not server.auth_required
        self.closing = False
        self.write_paused = False
        self.scratch = bytearray(_SCRATCH)
        self.scratch_view = memoryview(self.scratch)  # never resized, so one view serves
        self.scratch_len = 0
        # Set while a frame too large for scratch is being received into its own buffer.
        self.big: memoryview | None = None
        self.big_header: P.Header | None = None
        self.big_filled = 0
        # Bytes of a refused frame's body still to be read and dropped.
        self.discard_left = 0
        self.last_active = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.loop = asyncio.get_running_loop()

    # ---- asyncio callbacks ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=_WRITE_HIGH)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.connections.add(self)
        self.server.total_connections += 1
        loop = asyncio.get_running_loop()
        self.last_active = loop.time()
        self.timer = loop.call_later(self.server.config.idle_timeout, self._check_idle)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.server.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
        self.big = None

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
        self.last_active = self.loop.time()
        if self.big is not None:
            self.big_filled += nbytes
            if self.big_filled == len(self.big):
                body, header = self.big, self.big_header
                self.big, self.big_header = None, None
                assert header is not None
                self._dispatch(header, bytes(body[: header.key_len]), body[header.key_len :])
            return
        if self.discard_left:
            self.discard_left -= nbytes
            return
        self.scratch_len += nbytes
        self._parse_scratch()

    def pause_writing(self) -> None:
        # Replies are piling up (a large GET, or a client not reading): stop answering and
        # reading until they drain, so at most about one large reply is ever buffered.
        self.write_paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.closing or self.transport is None:
            return
        self._parse_scratch()  # requests that arrived while paused
        if not self.write_paused and not self.closing:
            self.transport.resume_reading()

    def eof_received(self) -> bool:
        return False  # close our side too

    def abort(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.abort()

    # ---- framing ----

    def _parse_scratch(self) -> None:
        buf, view, pos, end = self.scratch, self.scratch_view, 0, self.scratch_len
        while not self.closing and not self.write_paused and end - pos >= P.HEADER_SIZE:
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
                if self.discard_left:
                    break
                continue
            start = pos + P.HEADER_SIZE
            if end - pos >= total:
                key = bytes(view[start : start + header.key_len])
                payload = view[start + header.key_len : pos + total]
                pos += total
                if header.code == Op.PUT:
                    payload = memoryview(bytes(payload))  # scratch is reused: own the value
                self._dispatch(header, key, payload)
                continue
            if total > _SCRATCH:
                # Receive the body straight into its own buffer; copy what already arrived.
                have = end - start
                self.big = P.empty_buffer(header.body_len)
                self.big[:have] = view[start:end]
                self.big_filled = have
                self.big_header = header
                pos = end
            break
        rest = end - pos
        if rest and pos:
            buf[:rest] = buf[pos:end]
        self.scratch_len = rest

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
        return None

    def _fail(self, status: Status, request_id: int, message: str) -> None:
        """Sends an error reply and closes: after a framing error the stream cannot be trusted."""
        self.server.protocol_errors += 1
        log.info("closing connection %s: %s", self._peer(), message)
        self._reply(status, request_id, message.encode())
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def _peer(self) -> object:
        return self.transport.get_extra_info("peername") if self.transport else None

    def _reply(self, status: int, request_id: int, payload: P.Buffer = _EMPTY) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        header = P.encode_header(status, request_id, 0, len(payload))
        if len(payload) <= 4096:
            transport.write(header + payload)
        else:
            transport.write(header)
            transport.write(payload)

    def _check_idle(self) -> None:
        loop = asyncio.get_running_loop()
        timeout = self.server.config.idle_timeout
        idle = loop.time() - self.last_active
        if self.closing:
            return
        if idle >= timeout:
            log.info("closing idle or slow connection %s", self._peer())
            self.abort()
            return
        self.timer = loop.call_later(timeout - idle, self._check_idle)

    # ---- ops ----

    def _dispatch(self, h: P.Header, key: bytes, payload: memoryview) -> None:
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
            else:
                self._reply(Status.OK, rid, value)
        elif code == Op.EXISTS:
            self._reply(Status.OK if store.contains(key) else Status.NOT_FOUND, rid)
        elif code == Op.PREFIX_HITS:
            try:
                keys = P.decode_key_list(payload)
            except P.ProtocolError as exc:
                self._reply(Status.BAD_REQUEST, rid, str(exc).encode())
                return
            self._reply(Status.OK, rid, P.encode_count(store.prefix_hits(keys)))
        elif code == Op.PUT:
            if store.put(key, payload):
                self._reply(Status.OK, rid)
            else:
                self._reply(Status.TOO_LARGE, rid, b"entry exceeds the server's memory budget")
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
            ok = not self.server.auth_required or self.server.check_token(bytes(payload))
            self._reply(Status.OK if ok else Status.AUTH_FAILED, rid)
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
