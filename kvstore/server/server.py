"""The asyncio cache server: one `connection.Connection` per client over one ByteStore.

This module holds what is shared by all connections: configuration, the listening
socket, the deadline sweep, the queue of connections waiting for memory, counters, and
startup and shutdown. Framing and sending: `connection.py`; requests: `handlers.py`; the
memory ledger: `store.py`; the disk spill (off the event loop): `spill.py`. Imports run one
way, server -> connection -> handlers: each lower module declares what it needs of the
ones above as a `Protocol` (`ConnectionServer`, `HandlerServer`, `HandlerConnection`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from hostmem import ResidentGuard
from kvkeys.tenants import tenant_prefix
from kvstore.deadlines import CACHE_SERVER_FRAME_TIMEOUT_S, CACHE_SERVER_IDLE_TIMEOUT_S, CACHE_SERVER_SWEEP_S
from kvstore.server import protocol as P
from kvstore.server.connection import PER_CONNECTION_BYTES, PER_TLS_CONNECTION_BYTES, Connection
from kvstore.server.store import ByteStore
from kvstore.server.tenant_tokens import TenantTokens

log = logging.getLogger(__name__)

HEAP_SLACK_BYTES = 16 << 20  # allocator slack allowed above the budget (docs/protocol.md)


@dataclass
class ServerConfig:
    """What `kvtier cache-server` takes besides the store's budgets."""

    host: str = "127.0.0.1"
    port: int = 65432
    max_payload: int = P.DEFAULT_MAX_PAYLOAD
    auth_token: str | None = field(default=None, repr=False)  # the operator's: may do anything
    # --tenant-tokens: each binds its connections to one tenant's keys (kvstore/server/tenant_tokens.py)
    tenant_tokens: TenantTokens | None = field(default=None, repr=False)
    idle_timeout: float = CACHE_SERVER_IDLE_TIMEOUT_S  # a connection that sends nothing for this long is closed
    # Every frame must arrive whole (header and body) within this many seconds of its first
    # byte, and every reply piece must drain within it; also the TLS handshake's limit.
    frame_timeout: float = CACHE_SERVER_FRAME_TIMEOUT_S
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
        if self.tenant_tokens is not None:
            if not len(self.tenant_tokens):
                raise ValueError("tenant_tokens must hold at least one token (leave it unset for none)")
            if self.auth_token is not None and self.tenant_tokens.holds(self.auth_token):
                raise ValueError("a tenant token equals the operator's --auth-token")
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
        self._tenant_tokens = config.tenant_tokens
        self._tls = None
        if config.tls_cert is not None and config.tls_key is not None:
            self._tls = server_tls_context(config.tls_cert, config.tls_key)
        self.connections: set[Connection] = set()
        # Connections whose next body waits for memory, oldest first.
        self.waiting: dict[Connection, None] = {}
        self.total_connections = 0
        self.protocol_errors = 0
        self.refused_connections = 0
        self.frame_timeouts = 0
        self.busy_refusals = 0
        self.disk_read_timeouts = 0  # GETs answered as misses because the disk read was too slow
        self.forbidden = 0  # requests of tenant-token connections refused as outside their tenant
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
        self.store.on_freed = self.memory_freed  # spill writes done: waiters may fit
        if self.store.spill is not None:
            self.store.spill.attach(loop.call_soon_threadsafe)
        self._server = await loop.create_server(
            lambda: Connection(self), self.config.host, self.config.port, reuse_address=True,
            ssl=self._tls, ssl_handshake_timeout=self.config.frame_timeout if self._tls else None,
        )
        self._sweeper = loop.call_later(self._sweep_period, self._sweep)
        self.heap.reset_baseline()
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    @property
    def _sweep_period(self) -> float:
        return min(CACHE_SERVER_SWEEP_S, self.config.frame_timeout / 4, self.config.idle_timeout / 4)

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
        if (self.waiting or self.store.loads_waiting) and not self._wake_scheduled:
            self._wake_scheduled = True
            asyncio.get_running_loop().call_soon(self._wake_waiters)

    def _wake_waiters(self) -> None:
        self._wake_scheduled = False
        self.store.retry_loads()  # disk reads first: their GETs were parked earlier
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

    def authenticate(self, token: bytes) -> bytes | None:
        """Returns the key prefix a connection that sent `token` may touch: b"" (every key, and
        every op) for the operator's token, its tenant's prefix for a tenant token, None for
        any other token. Compared in constant time (a tenant token by its SHA-256)."""
        if self._token is not None and hmac.compare_digest(token, self._token):
            return b""
        tag = self._tenant_tokens.tag(token) if self._tenant_tokens is not None else None
        return tenant_prefix(tag).encode() if tag is not None else None

    @property
    def auth_required(self) -> bool:
        return self._token is not None or self._tenant_tokens is not None

    def stats_json(self) -> bytes:
        """Returns the STATS reply payload: store counters plus connection counters."""
        stats = self.store.stats().to_dict()
        stats["connections"] = len(self.connections)
        stats["total_connections"] = self.total_connections
        stats["protocol_errors"] = self.protocol_errors
        stats["refused_connections"] = self.refused_connections
        stats["frame_timeouts"] = self.frame_timeouts
        stats["busy_refusals"] = self.busy_refusals
        stats["disk_read_timeouts"] = self.disk_read_timeouts
        stats["forbidden"] = self.forbidden
        stats["waiting_for_memory"] = len(self.waiting)
        stats["heap_trims"] = self.heap.trims
        return json.dumps(stats).encode()


async def serve(
    store: ByteStore,
    config: ServerConfig,
    *,
    on_listening: Callable[[str, int], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Runs the server until SIGINT/SIGTERM (or `stop` is set), then closes every
    connection and, when the store has a disk spill, writes memory to disk so that a
    restart with the same directory keeps the data (giving up once the disk has finished
    nothing for the frame timeout)."""
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
        store.flush_to_disk(stall_timeout=config.frame_timeout)
