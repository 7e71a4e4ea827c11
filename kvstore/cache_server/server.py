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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from hostmem import ResidentGuard
from kvkeys.tenants import tenant_prefix
from kvsettings import flag_name, opt
from kvstore.cache_server import protocol as P
from kvstore.cache_server.connection import PER_CONNECTION_BYTES, PER_TLS_CONNECTION_BYTES, Connection
from kvstore.cache_server.store import ByteStore
from kvstore.cache_server.tenant_tokens import TenantTokens
from kvstore.deadlines import (
    CACHE_SERVER_CLIENT_TIMEOUT_S,
    CACHE_SERVER_FRAME_TIMEOUT_S,
    CACHE_SERVER_IDLE_TIMEOUT_S,
    CACHE_SERVER_SWEEP_S,
)
from kvstore.eviction import DEFAULT_POLICY, POLICIES
from kvstore.sizes import parse_size

log = logging.getLogger(__name__)

HEAP_SLACK_BYTES = 16 << 20  # allocator slack allowed above the budget (docs/protocol.md)


def _size(flag: str, text: str) -> int:
    """Returns the byte count of a size flag's text ('4GiB', '512MiB', '65536'); ValueError naming `flag`."""
    return parse_size(text, flag) or 0


@dataclass
class StoreBudgets:
    """The budgets of the cache server's store (`kvtier cache-server` builds its ByteStore and
    DiskSpill from them). Each is declared once, in its field: its default, and in the metadata
    (`kvsettings.opt`) its help, metavar and how its flag's text parses; the command line's flags
    are built from these fields and checked by `validate` alone."""

    max_bytes: int = field(default=4 << 30, metadata=opt(
        "memory budget: key + value bytes of all entries", "SIZE", parse=_size, shown="4GiB"))
    disk: str | None = field(default=None, metadata=opt(
        "spill evicted entries to this directory, created if absent (default: none, evicted entries are dropped)",
        "DIR"))
    max_disk_bytes: int = field(default=16 << 30, metadata=opt(
        "budget of the disk spill (file sizes)", "SIZE", parse=_size, shown="16GiB"))
    tenant_quota: int | None = field(default=None, metadata=opt(
        "most bytes one tenant (cache_salt) may hold, in memory and on the disk spill each; a tenant at its "
        "quota evicts its own least recently used entries (default: no quota)", "SIZE", parse=_size))
    pin_budget: int | None = field(default=None, metadata=opt(
        "most bytes operator pins (PIN, POST /kv/pin) may hold; pinned entries are never evicted, and with "
        "--disk their pins are kept across a restart (default: half of --max-bytes, at most --max-disk-bytes)",
        "SIZE", parse=_size))
    eviction: str = field(default=DEFAULT_POLICY, metadata=opt(
        f"eviction policy of the memory store: one of {', '.join(POLICIES)} (kvstore/eviction.py; "
        "benchmarks/results/trace_replay.md compares them on production traces)", "POLICY"))

    def validate(self) -> StoreBudgets:
        """Returns self; raises ValueError naming the first invalid field by its flag."""
        for name in ("max_bytes", "max_disk_bytes", "tenant_quota"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{flag_name(self, name)}: size {value} must be positive")
        if self.eviction not in POLICIES:
            raise ValueError(f"{flag_name(self, 'eviction')}: unknown policy {self.eviction!r}; "
                             f"choose one of {sorted(POLICIES)}")
        if self.pin_budget is not None and not 0 <= self.pin_budget <= self.max_bytes:
            raise ValueError(f"--pin-budget must be 0..--max-bytes ({self.max_bytes}), got {self.pin_budget}")
        if self.disk and self.pin_budget is not None and self.pin_budget > self.max_disk_bytes:
            raise ValueError(f"--pin-budget must not pass --max-disk-bytes ({self.max_disk_bytes}): pinned "
                             "entries must fit on the disk spill at shutdown")
        return self

    def store_pin_budget(self) -> int | None:
        """Returns the pin budget the store gets: the given one; with a disk spill and none given,
        half of the memory budget at most the spill's (pinned entries fit on it at shutdown);
        else None (the store's default)."""
        if self.pin_budget is None and self.disk:
            return min(self.max_bytes // 2, self.max_disk_bytes)
        return self.pin_budget


@dataclass
class ServerConfig:
    """What `kvtier cache-server` takes besides the store's budgets (`StoreBudgets`). Each setting
    is declared once, in its field: its default, and in the metadata (`kvsettings.opt`) its help
    and metavar; the command line's flags are built from these fields, and `validate` alone
    checks them (its errors name the flag)."""

    host: str = field(default="127.0.0.1", metadata=opt(
        "address to bind; the default is loopback: use 0.0.0.0 explicitly to serve the network", "HOST"))
    port: int = field(default=65432, metadata=opt("TCP port; 0 picks a free one and prints it", "N"))
    max_payload: int = field(default=P.DEFAULT_MAX_PAYLOAD, metadata=opt(
        "largest payload one frame may carry", "SIZE", parse=_size, shown="512MiB"))
    # the operator's: may do anything
    auth_token: str | None = field(default=None, repr=False, metadata=opt(
        "require clients to send this token first (default: $KVTIER_AUTH_TOKEN, else none)", "TOKEN"))
    # --tenant-tokens: each binds its connections to one tenant's keys (kvstore/cache_server/tenant_tokens.py);
    # the flag names the file kvtier/cmd_cache_server.py reads them from
    tenant_tokens: TenantTokens | None = field(default=None, repr=False, metadata=opt(
        "JSON/YAML file of per-tenant tokens: token -> tenant tag (16 hex) or {cache_salt: S} "
        "(tagged with $KVTIER_TENANT_TAG_KEY when set); a client that authenticates with one "
        "may touch only that tenant's keys (--auth-token stays the operator's, allowed "
        "everything); see docs/security.md", "FILE"))
    # a connection that sends nothing for this long is closed
    idle_timeout: float = field(default=CACHE_SERVER_IDLE_TIMEOUT_S, metadata=opt(
        "close connections that send nothing for this long", "SECONDS"))
    # Every frame must arrive whole (header and body) within this many seconds of its first
    # byte, and every reply piece must drain within it; also the TLS handshake's limit.
    frame_timeout: float = field(default=CACHE_SERVER_FRAME_TIMEOUT_S, metadata=opt(
        "each request frame must arrive whole, and each reply piece be read, within this long; also the TLS "
        "handshake limit and the longest a body waits for memory or a GET for the disk "
        f"(kvtier clients wait {CACHE_SERVER_CLIENT_TIMEOUT_S:g} s)", "SECONDS"))
    max_connections: int = field(default=256, metadata=opt(
        "connections served at once; more are refused with TOO_MANY_CONNECTIONS", "N"))
    # PEM certificate chain; with tls_key, clients must use TLS
    tls_cert: str | None = field(default=None, metadata=opt(
        "serve TLS with this PEM certificate chain (needs --tls-key; clients use kvtiers://)", "FILE"))
    tls_key: str | None = field(default=None, metadata=opt("PEM private key of --tls-cert", "FILE"))

    def validate(self, names: Mapping[str, str] | None = None) -> ServerConfig:
        """Returns self; raises ValueError naming the first invalid field by its flag, or by
        `names[field]` when the value came from elsewhere (e.g. "$KVTIER_AUTH_TOKEN")."""
        def name(key: str) -> str:
            return (names or {}).get(key) or flag_name(self, key) or key

        if not 0 <= self.port <= 65535:
            raise ValueError(f"{name('port')} must be in 0..65535, got {self.port}")
        if self.max_payload <= 0:
            raise ValueError(f"{name('max_payload')} must be positive, got {self.max_payload}")
        for key in ("idle_timeout", "frame_timeout"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{name(key)} must be positive, got {getattr(self, key)}")
        if self.max_connections < 1:
            raise ValueError(f"{name('max_connections')} must be at least 1, got {self.max_connections}")
        if self.auth_token is not None and not self.auth_token:
            # An empty token would silently mean "no auth": refuse it rather than guess.
            raise ValueError(f"{name('auth_token')} is empty; give a non-empty token, or leave --auth-token "
                             "and $KVTIER_AUTH_TOKEN unset to run without auth")
        if self.tenant_tokens is not None:
            if not len(self.tenant_tokens):
                raise ValueError(f"{name('tenant_tokens')} must hold at least one token (leave it unset for none)")
            if self.auth_token is not None and self.tenant_tokens.holds(self.auth_token):
                raise ValueError("a tenant token equals the operator's --auth-token")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        return self


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
