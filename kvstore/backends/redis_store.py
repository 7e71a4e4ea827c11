"""The `redis` tier: one Redis key per chunk, the value one self-describing blob.

URLs: `redis://[user:pass@]host:port/db`, `rediss://...` (TLS; `ssl_*` options are passed to
redis-py), `redis+cluster://host:port` / `rediss+cluster://...` (Redis Cluster: keys hash
across slots; pipelines are split per node by redis-py). Batched get/put and `prefix_hits`
are one pipelined round trip (per node); redis-py uses hiredis.

Options: `ttl_s` (expire chunks), `read_timeout_s` (default 0.5: the serving path, i.e.
existence checks and GETs, on its own connection pool, so a frozen server stalls a caller at
most this long per call), `socket_timeout_s` (default 5: writes, which run in the background),
`connect_timeout_s` (default 1; at most `read_timeout_s` for the serving pool),
`max_connections`, and any `ssl_*` keyword of redis-py. The byte budget bounds what this
client has written (evicting its own least recently used chunks); for a bound across all
clients of a shared server, set the server's `maxmemory` and an LRU policy.

A key that does not hold a chunk (another type, a garbage string) is a miss for that key
alone and is removed; it never fails its batch or the tier. Connection failures, timeouts
and refused writes (e.g. OOM under `noeviction`) raise BackendError. The GET fast path
reads replies off the connection's socket (`Connection._get_socket`) and packs commands with
redis-py's `Encoder`: both redis-py internals present in 7.x and 8.x, hence the
`redis>=7.0,<9` pin; `_check_redis_py` refuses other versions by name.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import redis
import redis.cluster
import torch
import xxhash
from redis._parsers.encoders import Encoder
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from kvstore import serde
from kvstore.backend import BackendError, BytesBackend, StoredValue
from kvstore.budget import ByteBudget
from kvstore.codecs import Buffer, Codec
from kvstore.config import TierSpec
from kvstore.eviction import make_policy

CHUNK_KEY_PATTERN = "kvtier:*"
"""Every chunk key (connector/keyspace.py) matches this; `wipe_all_chunks()` removes them."""

_NOT_A_CHUNK = b""
"""Stands for a key whose GET was an error reply (WRONGTYPE): it fails `serde.decode` like any
garbage, so the key is a miss, counted corrupt and removed."""


def _check_redis_py() -> None:
    """Raises ImportError naming the version if redis-py lacks the internals used here."""
    if not hasattr(redis.connection.AbstractConnection, "_get_socket"):
        raise ImportError(f"kvtier's redis tier needs redis-py >=7.0,<9 (Connection._get_socket); "
                          f"installed: {redis.__version__}")


_check_redis_py()


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


def _client_kwargs(options: dict[str, Any], serving: bool) -> dict[str, Any]:
    """Returns redis-py client keywords; `serving`: the pool for existence checks and GETs."""
    timeout = float(options.get("socket_timeout_s", 5.0))
    connect = float(options.get("connect_timeout_s", 1.0))
    if serving:
        timeout = float(options.get("read_timeout_s", 0.5))
        connect = min(connect, timeout)
    kw: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": connect,
        # the storage manager handles failures with backoff; redis-py must not stall a caller retrying
        "retry": Retry(NoBackoff(), 0),
        # RESP2: no server push frames can interleave with the GET replies `_read_bulk_replies` parses
        "protocol": 2,
    }
    if "max_connections" in options:
        kw["max_connections"] = int(options["max_connections"])
    kw.update({k: v for k, v in options.items() if k.startswith("ssl_")})
    unknown = set(options) - {"socket_timeout_s", "read_timeout_s", "connect_timeout_s", "max_connections"}
    unknown = {k for k in unknown if not k.startswith("ssl_")}
    if unknown:
        raise ValueError(f"redis tier: unknown option(s) {sorted(unknown)}; known: ttl_s, read_timeout_s, "
                         "socket_timeout_s, connect_timeout_s, max_connections, ssl_*")
    return kw


class _ReplyError(RedisError):
    """Redis answered a GET with something that is neither a bulk string, a null nor an error."""


def _read_bulk_replies(sock: Any, count: int) -> list[Buffer | None]:
    """Returns `count` RESP bulk-string replies (None for a null, `_NOT_A_CHUNK` for a key's
    error reply such as WRONGTYPE) read from `sock`, each received straight into its own
    numpy-allocated (huge-page) buffer: hiredis grows one buffer and copies every value out
    of it, and fresh small-page buffers fault on every 4 KiB. Raises _ReplyError / OSError;
    the caller then drops the connection, since the stream position is lost."""
    pending = bytearray()  # received, not yet consumed: reply headers and value tails
    out: list[Buffer | None] = []
    for _ in range(count):
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
        if line[:1] == b"-":  # an error reply (WRONGTYPE): this key only; the stream is intact
            out.append(_NOT_A_CHUNK)
            continue
        if line[:1] != b"$" or not line[1:].isdigit():
            raise _ReplyError(f"unexpected reply to GET: {line[:80]!r}")
        n = int(line[1:])
        value = np.empty(n + 2, dtype=np.uint8).data  # the value and its CRLF
        have = min(len(pending), n + 2)
        value[:have] = pending[:have]
        del pending[:have]
        while have < n + 2:
            got = sock.recv_into(value[have:], n + 2 - have)
            if not got:
                raise OSError("connection closed mid-value")
            have += got
        if value[n:] != b"\r\n":
            raise _ReplyError("bulk reply not terminated by CRLF")
        out.append(value[:n])
    if pending:
        raise _ReplyError("unexpected bytes after the GET replies")
    return out


class RedisBackend(BytesBackend):
    """Chunks in Redis (single node or cluster)."""

    name = "redis"

    def __init__(self, url: str, byte_budget: int | None = None, codec: Codec | str = "raw",
                 eviction: str = "lru", ttl_s: float | None = None, **client_options: Any) -> None:
        super().__init__(codec)
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
            raise ValueError(f"not a redis URL: {url!r}")
        self.cluster = scheme.endswith("+cluster")
        plain_url = urlunsplit((scheme.removesuffix("+cluster"), *parts[1:]))
        self.ttl_ms = int(ttl_s * 1000) if ttl_s else None
        try:
            # two pools: the serving path (short timeouts) never queues behind a slow write
            self.client = self._connect(plain_url, _client_kwargs(client_options, serving=False))
            self.reader = self._connect(plain_url, _client_kwargs(client_options, serving=True))
        except RedisError as exc:
            raise BackendError(f"redis tier cannot connect to {url}: {exc}") from exc
        self.url = url
        self._lock = threading.Lock()
        self._stripes = [threading.Lock() for _ in range(64)]
        self._budget = ByteBudget(byte_budget, make_policy(eviction))
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
        return cls(spec.url, byte_budget=spec.budget, codec=spec.codec, eviction=spec.eviction, ttl_s=ttl, **opts)

    def set_pin_check(self, is_pinned: Callable[[str], bool]) -> None:
        self._budget.is_pinned = is_pinned

    def encode(self, key: str, kv: torch.Tensor) -> StoredValue:
        """Returns the value unjoined for a single node (sent in two parts by SplitValuePacker);
        joined for a cluster, whose per-node clients use redis-py's own packer."""
        if self.cluster:
            return serde.encode(key, kv, self.codec)
        return serde.encode_split(key, kv, self.codec)

    def check(self) -> None:
        self._call("ping", self.client.ping)

    def _pipeline(self) -> Any:
        return self.client.pipeline(transaction=False)

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (RedisError, OSError) as exc:
            raise BackendError(f"redis tier {what} failed ({self.url}): {exc}") from exc

    # -- BytesBackend hooks --------------------------------------------------------------
    def _contains(self, key: str) -> bool:
        return self._batched_contains([key])[0]

    def _get_many(self, keys: Sequence[str]) -> list[Any]:
        """Returns the values of `keys` (None per missing key) in one pipelined round trip,
        read by `_read_bulk_replies` on a pooled connection (redis-py's reader for a cluster)."""
        if self.cluster:
            return [_NOT_A_CHUNK if isinstance(r, redis.ResponseError) else r for r in self._per_key("get", keys)]
        assert isinstance(self.reader, redis.Redis)  # a single node (clusters returned above)
        pool = self.reader.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command(conn.pack_commands([("GET", k) for k in keys]))
            sock = conn._get_socket()
            if sock is None:
                raise OSError("no socket after sending")
            return _read_bulk_replies(sock, len(keys))
        except BaseException:
            conn.disconnect()  # its stream position is unknown: never reuse it
            raise
        finally:
            pool.release(conn)

    def _per_key(self, command: str, keys: Sequence[str], *args: Any, client: Any = None) -> list[Any]:
        """Returns the replies to `command key *args` sent once per key, in one pipelined round
        trip on `client` (default: the serving one). A key's error reply (WRONGTYPE) comes back
        as a ResponseError in its place; a connection failure raises."""
        pipe = (client or self.reader).pipeline(transaction=False)
        for key in keys:
            getattr(pipe, command)(key, *args)
        replies = pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, Exception) and not isinstance(reply, redis.ResponseError):
                raise reply
        return replies

    def _batched_contains(self, keys: Sequence[str]) -> list[bool]:
        """Returns, per key, whether it holds something that starts like a chunk (one GETRANGE
        of the header per key, one round trip); a key holding anything else is removed."""
        if not keys:
            return []
        replies = self._call("exists", lambda: self._per_key("getrange", keys, 0, serde.MAX_HEADER_LEN - 1))
        held = [isinstance(r, bytes) and serde.looks_like_value(r) for r in replies]
        bad = [k for k, r, h in zip(keys, replies, held) if not h and r != b""]
        if bad:
            with self._stats_lock:
                self._corrupt += len(bad)
            for key in bad:
                self._delete(key)
        return held

    def _get_bytes(self, key: str) -> Buffer | None:
        return self._batched_get_bytes([key])[0]

    def _batched_get_bytes(self, keys: Sequence[str]) -> list[Buffer | None]:
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
        return list(admitted.items()), victims

    def _put_bytes(self, key: str, value: StoredValue) -> bool:
        return self._batched_put_bytes([(key, value)])[0]

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
            self._call("set", run)
            self._evicted(victims)
            return [k in kept for k, _ in items]

    def _delete(self, key: str) -> bool:
        with self._key_locks([key]):
            with self._lock:
                self._budget.remove(key)
            # on the serving pool: a bad value found by a read is removed within that read's bounds
            return bool(self._call("delete", lambda: self.reader.unlink(key)))

    def _clear(self) -> None:
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

    def _unlink_all(self, keys: Sequence[str]) -> None:
        for i in range(0, len(keys), 500):
            self._per_key("unlink", keys[i : i + 500], client=self.client)

    def _usage(self) -> tuple[int, int, int | None, int]:
        with self._lock:
            return len(self._budget), self._budget.used, self._budget.budget, self._evictions

    def close(self) -> None:
        for client in (self.client, self.reader):
            try:
                client.close()
            except (RedisError, OSError):
                pass
