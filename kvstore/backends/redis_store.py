"""The `redis` tier: one Redis key per chunk, the value one self-describing blob.

URLs: `redis://[user:pass@]host:port/db`, `rediss://...` (TLS; `ssl_*` options are passed to
redis-py), `redis+cluster://host:port` / `rediss+cluster://...` (Redis Cluster: keys hash
across slots; pipelines are split per node by redis-py). Batched get/put and `prefix_hits`
are one pipelined round trip (per node). hiredis is used by redis-py when installed.

Options: `ttl_s` (expire chunks), `socket_timeout_s` (default 5), `connect_timeout_s`
(default 1), `max_connections`, and any `ssl_*` keyword of redis-py. The byte budget bounds
what this client has written (evicting its own least recently used chunks); for a bound
across all clients of a shared server, set the server's `maxmemory` and an LRU policy.
Connection failures and timeouts raise BackendError.
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
from kvstore.backend import BackendError, BytesBackend
from kvstore.budget import ByteBudget
from kvstore.codecs import Buffer, Codec
from kvstore.config import TierSpec
from kvstore.eviction import make_policy

CHUNK_KEY_PATTERN = "kvtier:*"
"""Every `ChunkKey.to_str()` matches this; `clear()` removes what matches it."""


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


def _client_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "socket_timeout": float(options.get("socket_timeout_s", 5.0)),
        "socket_connect_timeout": float(options.get("connect_timeout_s", 1.0)),
        # the storage manager handles failures with backoff; redis-py must not stall a caller retrying
        "retry": Retry(NoBackoff(), 0),
        # RESP2: no server push frames can interleave with the GET replies `_read_bulk_replies` parses
        "protocol": 2,
    }
    if "max_connections" in options:
        kw["max_connections"] = int(options["max_connections"])
    kw.update({k: v for k, v in options.items() if k.startswith("ssl_")})
    return kw


class _ReplyError(RedisError):
    """Redis answered a GET with an error reply, or with something that is not a bulk string."""


def _read_bulk_replies(sock: Any, count: int) -> list[memoryview | None]:
    """Returns `count` RESP bulk-string replies (None for a null) read from `sock`, each
    received straight into its own numpy-allocated (huge-page) buffer: hiredis grows one
    buffer and copies every value out of it, and fresh small-page buffers fault on every
    4 KiB. Raises _ReplyError / OSError; the caller then drops the connection, since the
    stream position is lost."""
    pending = bytearray()  # received, not yet consumed: reply headers and value tails
    out: list[memoryview | None] = []
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
        if line[:1] != b"$" or not line[1:].isdigit():
            raise _ReplyError(f"unexpected reply to GET: {line[:80]!r}")
        n = int(line[1:])
        value = memoryview(np.empty(n + 2, dtype=np.uint8))  # the value and its CRLF
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
        kw = _client_kwargs(client_options)
        self.ttl_ms = int(ttl_s * 1000) if ttl_s else None
        try:
            if self.cluster:
                kw.pop("max_connections", None)
                self.client: redis.Redis | redis.cluster.RedisCluster = redis.cluster.RedisCluster.from_url(plain_url, **kw)
            else:
                self.client = redis.Redis.from_url(plain_url, command_packer=SplitValuePacker(), **kw)
        except RedisError as exc:
            raise BackendError(f"redis tier cannot connect to {url}: {exc}") from exc
        self.url = url
        self._lock = threading.Lock()
        self._stripes = [threading.Lock() for _ in range(64)]
        self._budget = ByteBudget(byte_budget, make_policy(eviction))
        self._evictions = 0

    @classmethod
    def from_spec(cls, spec: TierSpec) -> RedisBackend:
        opts = dict(spec.options)
        ttl = opts.pop("ttl_s", None)
        return cls(spec.url, byte_budget=spec.budget, codec=spec.codec, eviction=spec.eviction, ttl_s=ttl, **opts)

    def set_pin_check(self, is_pinned: Callable[[str], bool]) -> None:
        self._budget.is_pinned = is_pinned

    def encode(self, key: str, kv: torch.Tensor) -> Any:
        """Returns the value unjoined for a single node (sent in two parts by SplitValuePacker);
        joined for a cluster, whose per-node clients use redis-py's own packer."""
        if self.cluster:
            return serde.encode(key, kv, self.codec)
        return serde.encode_split(key, kv, self.codec)

    def _pipeline(self) -> Any:
        return self.client.pipeline(transaction=False)

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (RedisError, OSError) as exc:
            raise BackendError(f"redis tier {what} failed ({self.url}): {exc}") from exc

    # -- BytesBackend hooks --------------------------------------------------------------
    def _contains(self, key: str) -> bool:
        return bool(self._call("exists", lambda: self.client.exists(key)))

    def _get_many(self, keys: Sequence[str]) -> list[Any]:
        """Returns the values of `keys` (None per missing key) in one pipelined round trip,
        read by `_read_bulk_replies` on a pooled connection (redis-py's reader for a cluster)."""
        if self.cluster:
            return self._per_key("get", keys)
        pool = self.client.connection_pool
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

    def _per_key(self, command: str, keys: Sequence[str]) -> list[Any]:
        """Returns the replies to `command` sent once per key, in one pipelined round trip."""
        pipe = self._pipeline()
        for key in keys:
            getattr(pipe, command)(key)
        return pipe.execute()

    def _batched_contains(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        return [bool(x) for x in self._call("exists", lambda: self._per_key("exists", keys))]

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

    def _admit(self, items: Sequence[tuple[str, Buffer]]) -> tuple[list[tuple[str, Buffer]], list[str]]:
        """Returns (items that fit, keys to evict first), recording the admitted sizes."""
        admitted: dict[str, Buffer] = {}
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

    def _put_bytes(self, key: str, value: Buffer) -> None:
        self._batched_put_bytes([(key, value)])

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

    def _batched_put_bytes(self, items: Sequence[tuple[str, Buffer]]) -> None:
        with self._key_locks(k for k, _ in items):
            admitted, victims = self._admit(items)
            if not admitted and not victims:
                return

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

    def _delete(self, key: str) -> bool:
        with self._key_locks([key]):
            with self._lock:
                self._budget.remove(key)
            return bool(self._call("delete", lambda: self.client.delete(key)))

    def _clear(self) -> None:
        def run() -> None:
            keys = list(self.client.scan_iter(match=CHUNK_KEY_PATTERN, count=1000))
            with self._lock:
                keys.extend(self._budget.sizes)
                self._budget.clear()
            for i in range(0, len(keys), 500):
                self._per_key("delete", keys[i : i + 500])

        self._call("clear", run)

    def _usage(self) -> tuple[int, int, int | None, int]:
        with self._lock:
            return len(self._budget), self._budget.used, self._budget.budget, self._evictions

    def close(self) -> None:
        try:
            self.client.close()
        except (RedisError, OSError):
            pass
