"""The `redis` tier: one Redis key per chunk, the value one self-describing blob.

URLs: `redis://[user:pass@]host:port/db`, `rediss://...` (TLS; `ssl_*` options are passed to
redis-py), `redis+cluster://host:port` / `rediss+cluster://...` (Redis Cluster: keys hash
across slots). Batched get/put and `prefix_hits` are one pipelined round trip (per node);
batched GET replies are read off each node's socket by kvtier's reader (redis_wire.py),
checked as they arrive; the rest goes through redis-py (hiredis).

Options: `ttl_s` (expire chunks), the deadlines every remote tier has (kvstore/deadlines.py:
`lookup_timeout_s` 0.5 s for existence checks, `load_timeout_s` 1 s for GETs, `write_timeout_s`
5 s for the background writes, `connect_timeout_s` 1 s, at most a pool's deadline; each kind of
call has its own connection pool, so a frozen server stalls a lookup or a load at most its
deadline and a lookup never queues behind a slow write; the older `read_timeout_s` sets the
lookup and load deadlines, `socket_timeout_s` the write deadline), `max_connections`, and any
`ssl_*` keyword of redis-py. The byte budget bounds what this client has written (evicting its
own least recently used chunks); for a bound across all clients of a shared server, set the
server's `maxmemory` and an LRU policy.

A key that does not hold a chunk (another type, a garbage string) is a miss for that key
alone and is removed; it never fails its batch or the tier. Connection failures, timeouts
and refused writes (e.g. OOM under `noeviction`) raise BackendError. The GET fast path
reads replies off the connection's socket (`Connection._get_socket`) and packs commands with
redis-py's `Encoder`: both redis-py internals present in 7.x and 8.x, hence the
`redis>=7.0,<9` pin; `_check_redis_py` refuses other versions by name.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.cluster
import torch
import xxhash
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from kvkeys.tenants import KEY_ROOT
from kvstore import serde
from kvstore.backend import BackendError, BytesBackend, ReadValue, StoredValue
from kvstore.backends.redis_wire import SplitValuePacker, get_on_nodes, get_pipelined
from kvstore.budget import ByteBudget
from kvstore.capabilities import EvictingTier, PrefixDeletable, RemoteTier
from kvstore.codecs import Codec
from kvstore.deadlines import OPTIONS, CallKind, RemoteDeadlines
from kvstore.eviction import DEFAULT_POLICY, make_policy
from kvstore.store_config import TierSpec
from kvstore.tenant_quota import never_pinned

CHUNK_KEY_PATTERN = KEY_ROOT + "*"
"""Every chunk key (kvkeys/keyspace.py) matches this; `wipe_all_chunks()` removes them."""

def _check_redis_py() -> None:
    """Raises ImportError naming the version if redis-py lacks the internals used here."""
    if not hasattr(redis.connection.AbstractConnection, "_get_socket"):
        raise ImportError(f"kvtier's redis tier needs redis-py >=7.0,<9 (Connection._get_socket); "
                          f"installed: {redis.__version__}")


_check_redis_py()


# The redis tier's older option names -> the deadlines they set.
_DEADLINE_ALIASES = {"read_timeout_s": ("lookup_s", "load_s"), "socket_timeout_s": ("write_s",)}


def _client_kwargs(options: dict[str, Any], deadlines: RemoteDeadlines, kind: CallKind) -> dict[str, Any]:
    """Returns redis-py client keywords for the pool serving `kind` of call."""
    kw: dict[str, Any] = {
        "socket_timeout": deadlines.for_call(kind),
        "socket_connect_timeout": deadlines.connect_for(kind),
        # the storage manager handles failures with its breaker; redis-py must not stall a caller retrying
        "retry": Retry(NoBackoff(), 0),
        # RESP2: no server push frames can interleave with the GET replies `read_bulk_replies` parses
        "protocol": 2,
    }
    if "max_connections" in options:
        kw["max_connections"] = int(options["max_connections"])
    kw.update({k: v for k, v in options.items() if k.startswith("ssl_")})
    unknown = set(options) - {"max_connections", *OPTIONS, *_DEADLINE_ALIASES}
    unknown = {k for k in unknown if not k.startswith("ssl_")}
    if unknown:
        raise ValueError(f"redis tier: unknown option(s) {sorted(unknown)}; known: ttl_s, "
                         f"{', '.join(OPTIONS)}, {', '.join(_DEADLINE_ALIASES)}, max_connections, ssl_*")
    return kw


NOT_A_CHUNK = b""
"""Stands for a key whose GET was an error reply (WRONGTYPE): it fails `serde.decode` like any
garbage, so the key is a miss, counted corrupt and removed."""


def _chunk_or_not(reply: Any) -> Any:
    """Returns a GET reply as a value, with an error reply in its place made NOT_A_CHUNK."""
    return NOT_A_CHUNK if isinstance(reply, redis.ResponseError) else reply


class RedisBackend(BytesBackend, RemoteTier, EvictingTier, PrefixDeletable):
    """Chunks in Redis (single node or cluster)."""

    name = "redis"

    def __init__(self, url: str, byte_budget: int | None = None, codec: Codec | str = "raw",
                 eviction: str = DEFAULT_POLICY, ttl_s: float | None = None, tenant_quota: int | None = None,
                 **client_options: Any) -> None:
        super().__init__(codec)
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
            raise ValueError(f"not a redis URL: {url!r}")
        self.cluster = scheme.endswith("+cluster")
        plain_url = urlunsplit((scheme.removesuffix("+cluster"), *parts[1:]))
        self.ttl_ms = int(ttl_s * 1000) if ttl_s else None
        self.deadlines = RemoteDeadlines.from_options(client_options, f"redis tier {url}", _DEADLINE_ALIASES)
        try:
            # a pool per kind of call, each with its deadline: lookups never queue behind a slow write
            self.client = self._connect(plain_url, _client_kwargs(client_options, self.deadlines, "write"))
            self.reader = self._connect(plain_url, _client_kwargs(client_options, self.deadlines, "load"))
            self.lookups = self._connect(plain_url, _client_kwargs(client_options, self.deadlines, "lookup"))
        except RedisError as exc:
            raise BackendError(f"redis tier cannot connect to {url}: {exc}") from exc
        self.url = url
        self._lock = threading.Lock()
        self._stripes = [threading.Lock() for _ in range(64)]
        self._budget = ByteBudget(byte_budget, make_policy(eviction), tenant_quota)
        # Keys admitted and not yet written: never eviction victims, since a victim's DEL could
        # run before that SET and leave the value stored but no longer counted.
        self._writing: collections.Counter[str] = collections.Counter()
        self._pinned: Callable[[str], bool] = never_pinned
        self._budget.is_pinned = self._unevictable
        self._evictions = 0

    def _connect(self, url: str, kw: dict[str, Any]) -> redis.Redis | redis.cluster.RedisCluster:
        if self.cluster:
            kw.pop("max_connections", None)
            return redis.cluster.RedisCluster.from_url(url, **kw)
        return redis.Redis.from_url(url, command_packer=SplitValuePacker(), **kw)

    @classmethod
    def from_spec(cls, spec: TierSpec) -> RedisBackend:
        opts = dict(spec.options)
        ttl = opts.pop("ttl_s", None)
        return cls(spec.url, byte_budget=spec.budget, codec=spec.codec, eviction=spec.eviction, ttl_s=ttl,
                   tenant_quota=spec.tenant_quota, **opts)

    def set_hold_check(self, is_held: Callable[[str], bool]) -> None:
        self._pinned = is_held

    def _unevictable(self, key: str) -> bool:
        return key in self._writing or self._pinned(key)

    def _encode(self, key: str, kv: torch.Tensor) -> StoredValue:
        """Returns the value unjoined for a single node (sent in two parts by SplitValuePacker);
        joined for a cluster, whose per-node clients use redis-py's own packer."""
        if self.cluster:
            return serde.encode(key, kv, self.codec)
        return serde.encode_split(key, kv, self.codec)

    def check(self) -> None:
        """Returns once the server (a cluster: every primary) answers a PING within the lookup
        deadline; the breaker's probe."""
        if isinstance(self.lookups, redis.cluster.RedisCluster):
            cluster = self.lookups
            self._call("ping", lambda: cluster.ping(target_nodes=redis.cluster.RedisCluster.PRIMARIES))
        else:
            self._call("ping", self.lookups.ping)

    def _pipeline(self) -> Any:
        return self.client.pipeline(transaction=False)

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (RedisError, OSError) as exc:
            raise BackendError(f"redis tier {what} failed ({self.url}): {exc}") from exc

    # -- BytesBackend hooks and the contract ----------------------------------------------
    def _get_many(self, keys: Sequence[str]) -> list[Any]:
        """Returns the values of `keys` (None per missing key, NOT_A_CHUNK per key holding
        anything else) in one pipelined round trip per node, each reply read by
        `read_bulk_replies` as it arrives. A cluster's keys whose slot moved, or whose node
        failed, since this client learnt the slot map are fetched again through redis-py, which
        follows the redirection and refreshes the map; a timeout raises at once."""
        if not isinstance(self.reader, redis.cluster.RedisCluster):
            return [_chunk_or_not(r) for r in get_pipelined(self.reader, keys)]
        replies, again = get_on_nodes(self.reader, keys)
        if again:
            for i, reply in zip(again, self._per_key("get", [keys[i] for i in again])):
                replies[i] = reply
        return [_chunk_or_not(r) for r in replies]

    def _per_key(self, command: str, keys: Sequence[str], *args: Any, client: Any = None) -> list[Any]:
        """Returns the replies to `command key *args` sent once per key, in one pipelined round
        trip on `client` (default: the loads' pool). A key's error reply (WRONGTYPE) comes back
        as a ResponseError in its place; a connection failure raises."""
        pipe = (client or self.reader).pipeline(transaction=False)
        for key in keys:
            getattr(pipe, command)(key, *args)
        replies = pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, Exception) and not isinstance(reply, redis.ResponseError):
                raise reply
        return replies

    def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        """Returns, per key, whether it holds something that starts like a chunk (one GETRANGE
        of the header per key, one round trip); a key holding anything else is removed."""
        if not keys:
            return []
        replies = self._call("exists", lambda: self._per_key("getrange", keys, 0, serde.MAX_HEADER_LEN - 1,
                                                             client=self.lookups))
        held = [isinstance(r, bytes) and serde.looks_like_value(r) for r in replies]
        bad = [k for k, r, h in zip(keys, replies, held) if not h and r != b""]
        if bad:
            with self._stats_lock:
                self._corrupt += len(bad)
            for key in bad:
                self.delete(key)
        return held

    def _batched_get_bytes(self, keys: Sequence[str]) -> list[ReadValue | None]:
        if not keys:
            return []
        values = self._call("get", lambda: self._get_many(keys))
        self._touch(keys, values)
        return values

    def _touch(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        with self._lock:
            for key, value in zip(keys, values):
                if value is not None:
                    self._budget.touch(key)

    def _admit(self, items: Sequence[tuple[str, StoredValue]]) -> tuple[list[tuple[str, StoredValue]], list[str]]:
        """Returns (items that fit, keys to evict first), recording the admitted sizes."""
        admitted: dict[str, StoredValue] = {}
        victims: list[str] = []
        with self._lock:
            for key, value in items:
                plan = self._budget.plan(key, len(value))
                if plan is None:
                    with self._stats_lock:
                        self._rejected += 1
                    continue
                for victim in plan:
                    self._budget.remove(victim)
                    self._evictions += 1
                    # a victim written earlier in this batch is simply not written
                    if admitted.pop(victim, None) is None:
                        victims.append(victim)
                self._budget.add(key, len(value))
                admitted[key] = value
            self._writing.update(admitted.keys())
        return list(admitted.items()), victims

    @contextmanager
    def _key_locks(self, keys: Iterable[str]) -> Iterator[None]:
        """Holds the stripe locks of `keys` (in index order: no deadlock), so a put and a delete
        of one key cannot interleave between the accounting and the round trip; a write left in
        Redis but not in the accounting could break the budget."""
        idx = sorted({xxhash.xxh3_64_intdigest(k.encode()) % len(self._stripes) for k in keys})
        for i in idx:
            self._stripes[i].acquire()
        try:
            yield
        finally:
            for i in reversed(idx):
                self._stripes[i].release()

    def _batched_put_bytes(self, items: Sequence[tuple[str, StoredValue]]) -> list[bool]:
        with self._key_locks(k for k, _ in items):
            admitted, victims = self._admit(items)
            kept = {k for k, _ in admitted}
            if not admitted and not victims:
                return [False] * len(items)

            def run() -> None:
                pipe = self._pipeline()
                for victim in victims:  # evict before writing, so the budget holds at every moment
                    pipe.delete(victim)
                for key, value in admitted:
                    pipe.set(key, value, px=self.ttl_ms)
                pipe.execute()

            # on failure the writes stay accounted: their outcome is unknown, and over-counting
            # only evicts early, while under-counting could exceed the budget
            try:
                self._call("set", run)
            finally:
                with self._lock:
                    for key in kept:
                        self._writing[key] -= 1
                        if not self._writing[key]:
                            del self._writing[key]
            self._evicted(victims)
            return [k in kept for k, _ in items]

    def delete(self, key: str) -> bool:
        with self._key_locks([key]):
            with self._lock:
                self._budget.remove(key)
            # on the serving pool: a bad value found by a read is removed within that read's bounds
            return bool(self._call("delete", lambda: self.reader.unlink(key)))

    def clear(self) -> None:
        """Removes the chunks this client wrote (other clients' chunks stay: see wipe_all_chunks)."""
        with self._lock:
            keys = list(self._budget.sizes)
            self._budget.clear()
        self._call("clear", lambda: self._unlink_all(keys))

    def wipe_all_chunks(self) -> int:
        """Removes every chunk key (`kvtier:*`) on the server, whoever wrote it; returns how many.
        Meant for operators resetting a shared cache, never called by kvtier itself."""
        def run() -> int:
            keys = list(self.client.scan_iter(match=CHUNK_KEY_PATTERN, count=1000))
            self._unlink_all(keys)
            return len(keys)

        with self._lock:
            self._budget.clear()
        return int(self._call("wipe", run))

    def delete_prefix(self, prefix: str) -> int:
        """Removes every key on the server starting with `prefix`, whoever wrote it (SCAN +
        UNLINK); returns how many."""
        if not prefix or any(c in prefix for c in "*?[]\\"):
            raise ValueError(f"delete_prefix needs a non-empty prefix without glob characters, got {prefix!r}")

        def run() -> int:
            keys = [k.decode() if isinstance(k, bytes) else k
                    for k in self.client.scan_iter(match=prefix + "*", count=1000)]
            self._unlink_all(keys)
            with self._lock:
                for key in keys:
                    self._budget.remove(key)
            return len(keys)

        return int(self._call("delete_prefix", run))

    def _unlink_all(self, keys: Sequence[str]) -> None:
        for i in range(0, len(keys), 500):
            self._per_key("unlink", keys[i : i + 500], client=self.client)

    def _usage(self) -> tuple[int, int, int | None, int]:
        with self._lock:
            return len(self._budget), self._budget.used, self._budget.budget, self._evictions

    def close(self) -> None:
        for client in (self.client, self.reader, self.lookups):
            try:
                client.close()
            except (RedisError, OSError):
                pass
