"""The `kvtier://host:port` tier: chunks stored in a standalone `kvtier cache-server`
(`kvtiers://host:port`: the same over TLS, to a server started with --tls-cert/--tls-key).

The server holds opaque values (framed by `kvstore.serde` in BytesBackend) and enforces its
own byte budget (`--max-bytes`, plus `--max-disk-bytes` with `--disk`); this tier reports
the server's figures. Batches are pipelined, `prefix_hits` is one PREFIX_HITS request.
Connection failures raise BackendError; the next call reconnects (a server restart costs
one failed call at most, usually none: a stale pooled connection is retried once).

Options (`TierSpec.options` or the URL query): `auth_token` (default $KVTIER_AUTH_TOKEN), the
deadlines every remote tier has (kvstore/deadlines.py: `lookup_timeout_s` 0.5 s for existence
checks, which the server answers from memory, `load_timeout_s` 1 s for GETs, `write_timeout_s`
5 s for PUTs, which run in the background, `connect_timeout_s` 1 s, at most a pool's deadline;
each kind of call has its own connections, so a frozen server stalls a lookup or a load at
most its deadline; the older `timeout_s` sets the load and write deadlines), `pool_size` (8),
and for kvtiers:// `ca_file`
(PEM bundle the server's certificate must chain to; default: the system's trust store; the
certificate must name the URL's host). A `budget` or a non-LRU `eviction` is refused
(ValueError): the server owns both; `set_budget` (`/kv/budget`) changes the server's memory
budget and tenant quota at run time.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlsplit

import torch

from kvkeys.stored_keys import UsageGroup
from kvsettings import ProcessEnv
from kvstore import serde
from kvstore.backend import BackendError, BackendStats, BytesBackend, EntryInfo, ReadValue, StoredValue
from kvstore.backends.server_client import (
    CacheServerClient,
    Observer,
    Payload,
    ServerReplyError,
    ServerUnavailable,
)
from kvstore.budget import BudgetError
from kvstore.cache_server.protocol import ProtocolError, Status
from kvstore.capabilities import OperatedTier, PrefixDeletable, RemoteTier
from kvstore.codecs import Codec
from kvstore.deadlines import OPTIONS, CallKind, RemoteDeadlines
from kvstore.eviction import DEFAULT_POLICY
from kvstore.pin_set import PinError

if TYPE_CHECKING:
    from kvstore.store_config import TierSpec

DEFAULT_PORT = 65432
T = TypeVar("T")
# The cache server tier's older option name -> the deadlines it sets.
_DEADLINE_ALIASES = {"timeout_s": ("load_s", "write_s")}


class CacheServerBackend(BytesBackend, RemoteTier, OperatedTier, PrefixDeletable):
    """A tier backed by one cache server; thread-safe (a pooled client underneath)."""

    name = "kvtier"

    def __init__(
        self,
        host: str,
        port: int = DEFAULT_PORT,
        codec: Codec | str = "raw",
        *,
        auth_token: str | None = None,
        deadlines: RemoteDeadlines | None = None,
        pool_size: int = 8,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(codec)
        if not host:
            raise ValueError("cache server tier needs a host, e.g. kvtier://127.0.0.1:65432")
        self.deadlines = dl = deadlines or RemoteDeadlines()

        def pool(kind: CallKind) -> CacheServerClient:
            return CacheServerClient(host, port, auth_token=auth_token, timeout=dl.for_call(kind),
                                     connect_timeout=dl.connect_for(kind), pool_size=pool_size, tls=tls)

        # a pool per kind of call, each with its deadline: lookups never queue behind a large GET or PUT
        self.client = pool("write")
        self.loads = pool("load")
        self.lookup_client = pool("lookup")
        self.scheme = "kvtiers" if tls is not None else "kvtier"
        self._errors = 0
        self._last_pins: tuple[int, int, int | None] = (0, 0, None)  # as the last STATS said

    @classmethod
    def from_spec(cls, spec: TierSpec) -> CacheServerBackend:
        parts = urlsplit(spec.url)
        if spec.budget is not None:
            raise ValueError(f"{spec.url}: a cache server tier has no client-side budget; "
                             "set it on the server (kvtier cache-server --max-bytes)")
        if spec.tenant_quota is not None:
            raise ValueError(f"{spec.url}: a cache server tier has no client-side tenant_quota; "
                             "set it on the server, which counts every client's entries "
                             "(kvtier cache-server --tenant-quota)")
        if spec.eviction != DEFAULT_POLICY:
            raise ValueError(f"{spec.url}: a cache server tier has no client-side eviction policy; "
                             "set it on the server (kvtier cache-server --eviction)")
        opts = dict(spec.options)
        unknown = set(opts) - {"auth_token", "pool_size", "ca_file", *OPTIONS, *_DEADLINE_ALIASES}
        if unknown:
            raise ValueError(f"{spec.url}: unknown cache server tier option(s) {sorted(unknown)}")
        deadlines = RemoteDeadlines.from_options(opts, spec.url, _DEADLINE_ALIASES)
        tls = None
        if spec.scheme == "kvtiers":
            tls = client_tls_context(opts.get("ca_file"), spec.url)
        elif "ca_file" in opts:
            raise ValueError(f"{spec.url}: ca_file is for TLS; use kvtiers://")
        token = opts.get("auth_token", ProcessEnv.read().auth_token)
        return cls(parts.hostname or "", parts.port or DEFAULT_PORT, spec.codec,
                   auth_token=str(token) if token else None, deadlines=deadlines,
                   pool_size=int(opts.get("pool_size", 8)), tls=tls)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.client.host}:{self.client.port}"

    def __repr__(self) -> str:
        return f"CacheServerBackend({self.url})"

    def _io(self, fn: Callable[..., T], *args: object) -> T:
        """Runs one client call; returns its result, or raises BackendError naming the server."""
        try:
            return fn(*args)
        except (ServerUnavailable, ServerReplyError, OSError) as exc:
            with self._stats_lock:
                self._errors += 1
            raise BackendError(f"cache server {self.url}: {exc}") from exc

    def check(self) -> None:
        """Returns once the server answers a PING within the lookup deadline (the breaker's probe)."""
        self._io(self.lookup_client.ping)

    def _encode(self, key: str, kv: torch.Tensor) -> serde.SplitValue:
        """Returns the value unjoined: the client sends header and tensor bytes back to back."""
        return serde.encode_split(key, kv, self.codec)

    # -- BytesBackend hooks --------------------------------------------------------------
    def _batched_get_bytes(self, keys: Sequence[str]) -> Sequence[ReadValue | None]:
        """Returns the values, each checked as it arrived (`serde.ValueCheck.arrived`)."""
        checks: list[serde.ValueCheck] = []

        def observers() -> list[Observer | None]:
            checks[:] = [serde.ValueCheck(k) for k in keys]  # afresh for each attempt
            return [c.arrived for c in checks]
        values = self._io(self.loads.get_many, [k.encode() for k in keys], observers)
        return [None if v is None else serde.CheckedValue(v, c) for v, c in zip(values, checks, strict=True)]

    def _batched_put_bytes(self, items: Sequence[tuple[str, StoredValue]]) -> list[bool]:
        stored = self._io(self.client.put_many, [(k.encode(), _payload(v)) for k, v in items])
        refused = len(stored) - sum(stored)
        if refused:  # larger than the server's whole budget: not a tier failure
            with self._stats_lock:
                self._rejected += refused
        return stored

    def _usage(self) -> tuple[int, int, int | None, int]:
        s = self._io(self.lookup_client.stats)  # a /metrics scrape waits at most a lookup's deadline
        # an older server reports no pins
        self._last_pins = (s.get("pin_entries", 0), s.get("pin_bytes", 0), s.get("pin_budget"))
        return (s["entries"] + s["disk_entries"], s["bytes"] + s["disk_bytes"],
                s["max_bytes"] + s["max_disk_bytes"], s["evictions"])

    # -- the rest of the contract ---------------------------------------------------------
    def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        """Returns, per key, whether the server holds it (pipelined EXISTS, one round trip)."""
        return self._io(self.lookup_client.exists_many, [k.encode() for k in keys]) if keys else []

    def delete(self, key: str) -> bool:
        return self._io(self.client.delete, key.encode())

    def clear(self) -> None:
        """Removes every chunk on the server, whoever wrote it."""
        self._io(self.client.clear)

    def delete_prefix(self, prefix: str) -> int:
        """Removes every key on the server (memory and its disk) starting with `prefix`, in one
        request; returns how many."""
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix")
        return int(self._io(self.client.delete_prefix, prefix.encode()))

    def set_budget(self, byte_budget: int | None = None, pin_budget: int | None = None,
                   tenant_quota: int | None = None) -> None:
        """Sets the server's memory budget (`--max-bytes`) and/or tenant quota, met at once (SET_BUDGET);
        BudgetError for a pin budget (the server's `--pin-budget` is its own) or the server's
        refusal, BackendError when unreachable."""
        if pin_budget is not None:
            raise BudgetError(f"tier {self.name} ({self.url}): its pin budget is the server's own "
                              "(kvtier cache-server --pin-budget), not changed at run time")
        try:
            self.client.set_budget(byte_budget, tenant_quota)
        except ServerReplyError as exc:
            raise BudgetError(f"cache server {self.url} refused the limits: {exc}") from exc
        except (ServerUnavailable, OSError) as exc:
            raise BackendError(f"cache server {self.url}: {exc}") from exc

    # -- operating the cache: the server's own pins (PIN/UNPIN, within its --pin-budget) ----
    def describe(self, keys: Sequence[str]) -> list[EntryInfo | None]:
        """Returns per key the server's entry (its bytes, in memory or on its disk spill) and
        pin, or None when it holds none (one DESCRIBE round trip per 4096 keys)."""
        got = self._io(self.lookup_client.describe, [k.encode() for k in keys]) if keys else []
        return [None if d is None else
                EntryInfo(int(d["bytes"]), None, None, bool(d["pinned"]),
                          None if d["pin_expires_in_s"] is None else float(d["pin_expires_in_s"]))
                for d in got]

    def usage(self) -> dict[UsageGroup, tuple[int, int]]:
        """Returns the server's (entries, bytes) per (tenant, key family) of its chunks, in memory
        and on its disk spill (one USAGE round trip); BackendError when it cannot tell."""
        try:
            return self._io(self.lookup_client.usage)
        except ProtocolError as exc:
            raise BackendError(f"cache server {self.url}: {exc}") from exc

    def delete_idle(self, older_than_s: float) -> int:
        """Removes the server's chunks, in memory and on its disk spill, not used for
        `older_than_s` seconds, never pinned ones (one DELETE_IDLE); returns how many."""
        return int(self._io(self.client.delete_idle, older_than_s))

    def pin(self, keys: Sequence[str], ttl_s: float | None = None) -> int:
        """Pins `keys` on the server, all or none; returns the bytes newly pinned. PinError
        (nothing pinned) when it refuses (a key not held, its pin budget); BackendError when
        it cannot be reached or refuses this token (a tenant's, for another's keys)."""
        try:
            return self.client.pin([k.encode() for k in keys], ttl_s)
        except ServerReplyError as exc:
            if exc.status == Status.PIN_REFUSED:
                raise PinError(f"cache server {self.url}: {exc}") from None
            raise BackendError(f"cache server {self.url}: {exc}") from exc
        except (ServerUnavailable, OSError) as exc:
            raise BackendError(f"cache server {self.url}: {exc}") from exc

    def unpin(self, keys: Sequence[str]) -> int:
        """Releases the server's pins of `keys`; returns how many were pinned."""
        return self._io(self.client.unpin, [k.encode() for k in keys])

    def stats(self) -> BackendStats:
        """Returns the server's usage and pins with this client's counters; while the server
        is unreachable, usage reads as zero and `errors` counts the failure."""
        try:
            stats = super().stats()
        except BackendError:
            with self._stats_lock:
                stats = BackendStats(hits=self._hits, misses=self._misses, puts=self._puts,
                                     corrupt=self._corrupt, rejected=self._rejected)
        pins = self._last_pins
        stats.can_pin, stats.pinned_entries, stats.pinned_bytes, stats.pin_budget = True, *pins
        with self._stats_lock:
            stats.errors = self._errors
        return stats

    def close(self) -> None:
        for client in (self.client, self.loads, self.lookup_client):
            client.close()


def _payload(value: StoredValue) -> Payload:
    return (value.header, value.payload) if isinstance(value, serde.SplitValue) else value


def client_tls_context(ca_file: object, url: str) -> ssl.SSLContext:
    """Returns a TLS 1.2+ client context that verifies the server's certificate and host
    name against `ca_file` (a PEM bundle) or, when None, the system's trust store; raises
    ValueError naming the file when it cannot be loaded."""
    try:
        ctx = ssl.create_default_context(cafile=str(ca_file) if ca_file is not None else None)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"{url}: cannot load ca_file {ca_file!r}: {exc}") from exc
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx
