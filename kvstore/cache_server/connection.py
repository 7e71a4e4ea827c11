"""One cache-server connection: frames parsed from the socket, replies sent with backpressure.

Small frames are parsed straight out of a per-connection 64 KiB receive buffer (many per
recv when clients pipeline); a frame larger than that is received directly into one
buffer of its exact size, which then becomes the stored value, so a PUT payload is
copied once from the socket and never again. Any framing error gets an error reply and
the connection is closed: the other clients never notice. Requests run in
`handlers.dispatch`; replies go out in request order. What a connection needs of its
server is declared here (`ConnectionServer`), so this module never imports the server's.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from typing import Protocol

from kvstore.cache_server import protocol as P
from kvstore.cache_server.handlers import HandlerServer, ParkedGet, dispatch, early_refusal
from kvstore.cache_server.protocol import Op, Status
from kvstore.cache_server.store import ByteStore
from kvstore.deadlines import CACHE_SERVER_REFUSED_ABORT_S

log = logging.getLogger(__name__)

_SCRATCH = 64 << 10
# Largest piece of a reply handed to the transport at once. asyncio copies what the kernel
# does not take into its own buffer, and the next piece waits until that buffer is empty: so
# a connection holds at most this much copied reply, whatever the value's size.
_SEND_SLICE = 256 << 10
# Over TLS a slice is also encrypted into OpenSSL's buffer and copied out of it: smaller.
_TLS_SEND_SLICE = 64 << 10
_OUT_MAX_ITEMS = 64  # queued reply pieces past which a connection's requests wait
# Resident bytes outside the budget (docs/protocol.md, "Memory bound"): per connection its
# receive buffer and one copied reply slice; for the process, allocator slack.
PER_CONNECTION_BYTES = _SCRATCH + _SEND_SLICE
# Over TLS (measured with stalled readers): asyncio's 256 KiB TLS read buffer, OpenSSL's
# buffers and up to three copies of a 64 KiB slice (plaintext, encrypted, unsent).
PER_TLS_CONNECTION_BYTES = 640 << 10


class ConnectionLimits(Protocol):
    """The server's configuration a connection enforces."""

    max_connections: int
    max_payload: int
    idle_timeout: float
    frame_timeout: float


class ConnectionServer(HandlerServer, Protocol):
    """What a connection asks of the server that accepted it (`server.CacheServer`)."""

    store: ByteStore
    connections: set[Connection]
    waiting: dict[Connection, None]  # connections whose next body waits for memory, oldest first
    total_connections: int
    refused_connections: int
    protocol_errors: int
    frame_timeouts: int
    disk_read_timeouts: int

    @property
    def config(self) -> ConnectionLimits: ...

    def trim_heap(self, pending: int = 0) -> None: ...  # before `pending` bytes are allocated


class Connection(asyncio.BufferedProtocol):
    """Parses frames for one client and answers them in order."""

    def __init__(self, server: ConnectionServer) -> None:
        self.server = server
        self.store = server.store
        self.transport: asyncio.Transport | None = None
        self.authed = not server.auth_required
        self.scope = b""  # every key; a tenant token's AUTH narrows it to its tenant's prefix
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
        self.waiting = False  # the next frame waits for memory (reading paused)
        # Set while a GET waits for its value to be read from disk (reading paused).
        self.parked: ParkedGet | None = None
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
                # would reset the connection and could lose the refusal. Bounded: aborted after
                # CACHE_SERVER_REFUSED_ABORT_S.
                transport.write_eof()
                self.loop.call_later(CACHE_SERVER_REFUSED_ABORT_S, transport.abort)
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
                dispatch(self, header, bytes(body[: header.key_len]), body[header.key_len :], reserved)
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
            request_id = P.decode_header(self.scratch, self.server.config.max_payload).request_id
            self.fail(Status.BUSY, request_id, "server memory is held by other bodies in flight and "
                       f"replies being sent; waited {cfg.frame_timeout:g} s, retry later")
            return
        if self.parked is not None and self.parked.answer_if_overdue(now, cfg.frame_timeout):
            # The disk is too slow: a miss now beats a client left waiting (its read goes on).
            self.server.disk_read_timeouts += 1
            log.warning("a disk spill read took over %g s: answered as a miss", cfg.frame_timeout)
            self._parse_scratch()
            return
        if now - self.last_active >= cfg.idle_timeout:
            reason = "idle"
        elif (self.frame_start is not None and not self.waiting and self.parked is None and not self._backlogged()
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
        want_paused = self.waiting or self.parked is not None or self._backlogged()
        if want_paused != self.reading_paused and self.transport is not None and not self.closing:
            self.reading_paused = want_paused
            if want_paused:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    def _parse_scratch(self) -> None:
        buf, view, pos, end = self.scratch, self.scratch_view, 0, self.scratch_len
        framed = False
        while (not self.closing and not self.waiting and self.parked is None and not self._backlogged()
               and end - pos >= P.HEADER_SIZE):
            limit = self.server.config.max_payload if self.authed else _SCRATCH  # AUTH may precede
            try:
                header = P.decode_header(buf, limit, pos)
            except P.ProtocolError as exc:
                self.fail(Status.BAD_FRAME, 0, str(exc))
                return
            total = P.HEADER_SIZE + header.body_len
            refusal = early_refusal(self.store, header, _SCRATCH) if self.authed else None  # else: dispatch
            if refusal is not None:
                # Well-framed but refused before its body is received: answer now and drop
                # the body as it arrives, so the connection stays usable.
                self.reply(refusal[0], header.request_id, refusal[1].encode())
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
                reserved = 0
                if header.code == Op.PUT and self.authed:
                    if self.store.reserve(header.body_len):
                        reserved = header.body_len
                    elif self.store.can_make_room(header.body_len):
                        self._wait_for_memory()  # evicted entries are being spilled: wait for them
                        break
                    # else: replies and bodies hold the memory: the PUT is answered BUSY
                    payload = memoryview(bytes(payload))  # scratch is reused: own the value
                dispatch(self, header, key, payload, reserved)
                pos += total
                framed = True
                continue
            if total > _SCRATCH:
                # Receive the body straight into its own buffer, once the budget admits it.
                if not self.store.reserve(header.body_len):
                    self._wait_for_memory()
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

    def _wait_for_memory(self) -> None:
        self.waiting = True
        self.server.waiting[self] = None

    def resume(self) -> None:
        """Goes on with the requests that a parked GET held back."""
        self._parse_scratch()

    def fail(self, status: Status, request_id: int, message: str) -> None:
        """Sends an error reply and closes: after a framing error the stream cannot be trusted."""
        self.server.protocol_errors += status != Status.BUSY
        log.info("closing connection %s: %s", self._peer(), message)
        self.reply(status, request_id, message.encode())
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def _peer(self) -> object:
        return self.transport.get_extra_info("peername") if self.transport else None

    def reply(self, status: int, request_id: int, payload: P.Buffer = b"", pinned: bool = False) -> None:
        """Queues one reply. A `pinned` payload (a stored value, pinned by the caller) is
        sent from the store's own buffer, never copied per connection, and unpinned once
        handed to the transport."""
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

