"""One connection of the cache server's client (kvstore/backends/server_client.py): requests sent
back to back, replies read in order into buffers of their exact size, and the types both
sides of that exchange use (docs/protocol.md)."""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from io import BufferedReader
from itertools import count
from typing import cast

from kvstore import serde
from kvstore.cache_server import protocol as P
from kvstore.cache_server.protocol import Op, Status

INLINE = 64 << 10  # payloads up to this size are coalesced with their header in one send
# A reply claiming more than this is treated as a garbled stream rather than allocated.
_MAX_REPLY = 4 << 30


# Statuses after which the server closes the connection (some answer request id 0).
CLOSING = frozenset({Status.BAD_FRAME, Status.AUTH_REQUIRED, Status.AUTH_FAILED, Status.TOO_MANY_CONNECTIONS})


class ServerUnavailable(ConnectionError):
    """The server could not be reached, or the connection broke mid-call."""


class ServerTimeout(ServerUnavailable):
    """The server accepted or answered nothing within the timeout (not retried: it is alive)."""


class ServerReplyError(RuntimeError):
    """The server answered with an error status (auth failure, too large, bad request)."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        try:
            name = Status(status).name
        except ValueError:
            name = str(status)
        super().__init__(f"cache server replied {name}: {message}")


# A payload is one buffer, or a tuple of buffers sent back to back as one value (a chunk's
# header and its tensor's bytes: no join, no copy).
Payload = P.Buffer | tuple[P.Buffer, ...]


@dataclass
class Request:
    op: Op
    key: bytes = b""
    payload: Payload = b""

    @property
    def payload_len(self) -> int:
        parts = self.payload if isinstance(self.payload, tuple) else (self.payload,)
        return sum(memoryview(p).nbytes for p in parts)


Observer = Callable[[memoryview, int], None]
"""Told, as a reply's payload arrives, its whole buffer and how many bytes of it have arrived."""


@dataclass
class Reply:
    status: int
    payload: memoryview  # writable, owned by the caller


class ClientConnection:
    """One socket with a buffered reader; replies are checked against request ids."""

    def __init__(self, host: str, port: int, connect_timeout: float, timeout: float,
                 tls: ssl.SSLContext | None = None) -> None:
        scheme = "kvtiers" if tls is not None else "kvtier"
        try:
            self.sock = socket.create_connection((host, port), timeout=connect_timeout)
            if tls is not None:  # the handshake runs under the connect timeout
                self.sock = tls.wrap_socket(self.sock, server_hostname=host)
        except ssl.SSLError as exc:
            raise ServerUnavailable(f"TLS handshake with {scheme}://{host}:{port} failed: {exc}") from exc
        except OSError as exc:
            raise ServerUnavailable(f"cannot connect to {scheme}://{host}:{port}: {exc}") from exc
        if tls is not None:
            # TLS reads report a kernel timeout as an SSL error, not as "would block": use
            # Python's socket timeout there (a poll per call, small next to the cipher).
            self.sock.settimeout(timeout)
        else:
            # Kernel-enforced timeouts on a blocking socket: Python's own socket timeout costs
            # a poll() before every send and recv, which dominates small calls.
            self.sock.settimeout(None)
            tv = struct.pack("ll", int(timeout), int((timeout % 1) * 1e6))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # typeshed types makefile("rb") as IOBase unless buffering is -1/1; it is a BufferedReader
        self.rfile = cast(BufferedReader, self.sock.makefile("rb", buffering=INLINE))
        self.timeout = timeout
        self._ids = count(1)
        self._header = bytearray(P.HEADER_SIZE)

    def send(self, requests: Sequence[Request]) -> list[int]:
        """Sends the requests back to back; returns their request ids."""
        ids: list[int] = []
        pending: list[bytes | P.Buffer] = []
        try:
            for req in requests:
                rid = next(self._ids) & 0xFFFFFFFF
                ids.append(rid)
                pending.append(P.encode_header(req.op, rid, len(req.key), req.payload_len))
                pending.append(req.key)
                for part in req.payload if isinstance(req.payload, tuple) else (req.payload,):
                    view = memoryview(part).cast("B")
                    if len(view) <= INLINE:
                        pending.append(view)
                    else:
                        # Large part: flush what is queued, then send the caller's buffer itself.
                        self.sock.sendall(b"".join(pending))
                        pending.clear()
                        self.sock.sendall(view)
            if pending:
                self.sock.sendall(b"".join(pending))
        except BlockingIOError as exc:  # SO_SNDTIMEO expired
            raise ServerTimeout(f"the cache server accepted nothing for {self.timeout} s") from exc
        return ids

    def recv(self, request_id: int, observe: Observer | None = None) -> Reply:
        """Reads one reply into a buffer of its exact size (`observe` told as its payload
        arrives); raises ServerUnavailable if the stream ends or the reply does not answer
        `request_id`."""
        self._read_into(memoryview(self._header))
        try:
            h = P.decode_header(self._header, max_payload=_MAX_REPLY)
        except P.ProtocolError as exc:
            raise ServerUnavailable(f"garbled reply from the cache server: {exc}") from exc
        payload = P.empty_buffer(h.payload_len)
        if h.payload_len:
            self._read_into(payload, observe)
        if h.request_id != request_id and h.code not in CLOSING:
            raise ServerUnavailable(f"reply for request {h.request_id} while waiting for {request_id}")
        return Reply(h.code, payload)

    def _read_into(self, view: memoryview, observe: Observer | None = None) -> None:
        piece = serde.CHECK_PIECE if observe is not None else len(view)
        have = 0
        while have < len(view):
            n = self.rfile.readinto(view[have:have + piece])
            if n is None:  # SO_RCVTIMEO expired (the reader reports it as "would block")
                raise ServerTimeout(f"no reply from the cache server within {self.timeout} s")
            if not n:
                raise ServerUnavailable("the cache server closed the connection")
            have += n
            if observe is not None:
                observe(view, have)

    def close(self) -> None:
        try:
            self.rfile.close()
            self.sock.close()
        except OSError:
            pass
