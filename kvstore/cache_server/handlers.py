"""The cache server's request handlers: one framed request in, its reply queued.

Every handler runs on the event loop and does bounded work. A GET whose value is on the
disk spill starts a read on the spill's worker thread (after memory is made for it) and
parks its connection (no later request of that connection runs, so replies stay in order)
until the value is read or its deadline passes: `ParkedGet` is that state's one owner.

Handlers sit below the connection in the import order (server -> connection -> handlers):
what they need of a connection and of the server is declared here, as `HandlerConnection`
and `HandlerServer`, and `connection.Connection` and `server.CacheServer` provide it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Protocol

from kvstore.cache_server import protocol as P
from kvstore.cache_server.protocol import Op, Status
from kvstore.cache_server.store import ByteStore
from kvstore.pin_set import PinError

INLINE_REPLY = 4096  # values up to this size are copied into their reply; larger ones are pinned
_OPS = frozenset(int(op) for op in Op)
# What a tenant token's connection may do (docs/protocol.md, "Tenant tokens"): ops that name
# keys, each key under its tenant's prefix (the list ops: every key of their list); ops that
# name none and reveal no entry. Every other op (CLEAR, SET_BUDGET, and any op added later,
# until it is listed here) is the operator's.
_LIST_OPS = frozenset({Op.PREFIX_HITS, Op.PIN, Op.UNPIN, Op.DESCRIBE})
_KEYED_OPS = frozenset({Op.GET, Op.EXISTS, Op.PUT, Op.DELETE, Op.DELETE_PREFIX, Op.USAGE, *_LIST_OPS})
_UNKEYED_OPS = frozenset({Op.PING, Op.AUTH, Op.STATS})


class HandlerServer(Protocol):
    """What a handler asks of the server: auth, the STATS payload, two counters, a retry of
    the bodies waiting for memory."""

    busy_refusals: int
    forbidden: int

    @property
    def auth_required(self) -> bool: ...

    def authenticate(self, token: bytes) -> bytes | None: ...

    def stats_json(self) -> bytes: ...

    def memory_freed(self) -> None: ...


class HandlerConnection(Protocol):
    """What a handler asks of the connection whose request it runs."""

    authed: bool
    # The key prefix this connection may touch: b"" (everything) unless it authenticated with
    # a tenant token, then that tenant's `kvtier:tenant-<tag>:`.
    scope: bytes
    closing: bool
    parked: ParkedGet | None  # the GET holding this connection's later requests back

    @property
    def server(self) -> HandlerServer: ...

    @property
    def store(self) -> ByteStore: ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    def reply(self, status: int, request_id: int, payload: P.Buffer = b"", pinned: bool = False) -> None: ...

    def fail(self, status: Status, request_id: int, message: str) -> None: ...

    def resume(self) -> None: ...


def dispatch(conn: HandlerConnection, h: P.Header, key: bytes, payload: memoryview, reserved: int = 0) -> None:
    """Runs one request of `conn`, queuing its reply (a GET of a spilled value parks `conn`
    until the value is read). `reserved`: budget bytes held by this PUT's body, which the
    store takes over (the caller releases them for any other op)."""
    rid = h.request_id
    if not conn.authed:
        if h.code != Op.AUTH:
            conn.fail(Status.AUTH_REQUIRED, rid, "authentication required: send AUTH first")
        else:
            authenticate(conn, rid, payload)
        return
    store = conn.store
    code = h.code
    if conn.scope and code not in _LIST_OPS and out_of_scope(conn.scope, code, key):  # lists: below
        forbid(conn, rid, code, reserved if code == Op.PUT else 0)
        return
    if code == Op.GET:
        value = store.get(key)
        if value is not None:
            send_value(conn, rid, key, value)
        else:
            ParkedGet.start(conn, rid, key)
    elif code == Op.EXISTS:
        conn.reply(Status.OK if store.contains(key) else Status.NOT_FOUND, rid)
    elif code == Op.PREFIX_HITS:
        keys = scoped_keys(conn, rid, code, lambda: P.decode_key_list(payload, P.MAX_KEYS_PER_REQUEST))
        if keys is not None:
            conn.reply(Status.OK, rid, P.encode_count(store.prefix_hits(keys)))
    elif code in (Op.PIN, Op.UNPIN, Op.DESCRIBE):
        pins(conn, rid, code, payload)
    elif code == Op.PUT:
        if store.put(key, payload, reserved):
            conn.reply(Status.OK, rid)
        elif not store.fits(len(key), len(payload)):
            conn.reply(Status.TOO_LARGE, rid, b"entry exceeds the server's memory budget")
        else:
            conn.server.busy_refusals += 1
            conn.reply(Status.BUSY, rid, b"no memory free for this entry now: replies being sent "
                       b"and bodies in flight hold it; retry later")
    elif code == Op.DELETE:
        conn.reply(Status.OK if store.delete(key) else Status.NOT_FOUND, rid)
    elif code == Op.DELETE_PREFIX:  # one pass over the keys: an operator's call (a tenant's removal)
        if not key:
            conn.reply(Status.BAD_REQUEST, rid, b"DELETE_PREFIX needs a non-empty prefix (CLEAR removes all)")
        else:
            conn.reply(Status.OK, rid, P.encode_count(store.delete_prefix(key)))
            conn.server.memory_freed()  # bodies waiting for memory may fit now
    elif code == Op.USAGE:  # one pass over the keys, as DELETE_PREFIX; a tenant asks under its own prefix
        groups = store.usage(key)
        if len(groups) > P.MAX_USAGE_GROUPS:
            conn.reply(Status.TOO_LARGE, rid, f"more than {P.MAX_USAGE_GROUPS} (tenant, key family) groups; "
                       "ask per tenant prefix".encode())
        else:
            conn.reply(Status.OK, rid, P.encode_usage(groups))
    elif code == Op.DELETE_IDLE:  # the operator's (not in _KEYED_OPS nor _UNKEYED_OPS)
        try:
            older_than_ms = P.decode_count(payload)
        except P.ProtocolError as exc:
            conn.reply(Status.BAD_REQUEST, rid, str(exc).encode())
            return
        conn.reply(Status.OK, rid, P.encode_count(store.delete_idle(older_than_ms / 1000)))
        conn.server.memory_freed()
    elif code == Op.PING:
        conn.reply(Status.OK, rid, b"PONG")
    elif code == Op.CLEAR:
        store.clear()  # the spill's files go in the background: bounded work here
        conn.reply(Status.OK, rid)
    elif code == Op.STATS:
        conn.reply(Status.OK, rid, conn.server.stats_json())
    elif code == Op.SET_BUDGET:  # the operator's (not in _KEYED_OPS nor _UNKEYED_OPS)
        try:
            store.set_limits(**P.decode_limits(payload))
        except ValueError as exc:  # ProtocolError included
            conn.reply(Status.BAD_REQUEST, rid, str(exc).encode())
            return
        conn.server.memory_freed()  # a budget raised: bodies waiting for memory may fit
        conn.reply(Status.OK, rid, conn.server.stats_json())
    elif code == Op.AUTH:
        # Already authenticated (or auth disabled): a valid token (re)sets the connection's scope.
        if not conn.server.auth_required:
            conn.reply(Status.OK, rid)
        else:  # a wrong token is a wrong token, whenever it comes: close
            authenticate(conn, rid, payload)
    else:  # unreachable: unknown ops are refused while framing
        conn.reply(Status.UNKNOWN_OP, rid, f"unknown op {code}".encode())


def scoped_keys(conn: HandlerConnection, request_id: int, code: int,
                decode: Callable[[], list[bytes]]) -> list[bytes] | None:
    """Returns the key list `decode()` reads from a request, or None once the request was
    answered: BAD_REQUEST (malformed), FORBIDDEN (a tenant token's list naming a key outside
    its tenant: nothing done)."""
    try:
        keys = decode()
    except P.ProtocolError as exc:
        conn.reply(Status.BAD_REQUEST, request_id, str(exc).encode())
        return None
    if conn.scope and any(out_of_scope(conn.scope, code, k) for k in keys):
        forbid(conn, request_id, code)
        return None
    return keys


def pins(conn: HandlerConnection, request_id: int, code: int, payload: memoryview) -> None:
    """Answers a PIN (the bytes newly pinned, or PIN_REFUSED), UNPIN (how many were pinned) or
    DESCRIBE (JSON: per key null, or its bytes and pin); a tenant token's list must hold only
    its own keys (else FORBIDDEN, nothing done)."""
    ttl_s: float | None = None

    def decode() -> list[bytes]:
        nonlocal ttl_s
        if code != Op.PIN:
            return P.decode_key_list(payload, P.MAX_KEYS_PER_REQUEST)
        ttl_s, keys = P.decode_pin(payload)
        return keys

    keys = scoped_keys(conn, request_id, code, decode)
    if keys is None:
        return
    store = conn.store
    if code == Op.PIN:
        try:
            conn.reply(Status.OK, request_id, P.encode_count(store.pin_keys(keys, ttl_s)))
        except PinError as exc:
            conn.reply(Status.PIN_REFUSED, request_id, str(exc).encode())
    elif code == Op.UNPIN:
        conn.reply(Status.OK, request_id, P.encode_count(store.unpin_keys(keys)))
    else:
        described = [None if d is None else
                     {"bytes": d[0], "pinned": d[1] is not None,
                      "pin_expires_in_s": None if d[1] is None else d[1].expires_in_s}
                     for d in store.describe_keys(keys)]
        conn.reply(Status.OK, request_id, json.dumps(described).encode())


def authenticate(conn: HandlerConnection, request_id: int, token: memoryview) -> None:
    """Answers an AUTH: OK, the connection then bound to the token's scope (everything for the
    operator's token, one tenant's keys for a tenant token), or AUTH_FAILED and close."""
    scope = conn.server.authenticate(bytes(token))
    if scope is None:
        conn.fail(Status.AUTH_FAILED, request_id, "wrong auth token")
        return
    conn.authed, conn.scope = True, scope
    conn.reply(Status.OK, request_id)


def out_of_scope(scope: bytes, code: int, key: bytes) -> bool:
    """Returns whether a connection bound to the non-empty key prefix `scope` (a tenant
    token's) may not run op `code` naming `key` (for PREFIX_HITS: one key of its list; for
    DELETE_PREFIX: the prefix, which must itself start with `scope`)."""
    if code in _UNKEYED_OPS:
        return False
    return code not in _KEYED_OPS or not key.startswith(scope)


def forbid(conn: HandlerConnection, request_id: int, code: int, reserved: int = 0) -> None:
    """Refuses a tenant token's request outside its tenant (FORBIDDEN, the connection stays
    open), handing back the budget bytes `reserved` a PUT's body held (a PUT's only: the
    caller hands back any other op's)."""
    if reserved:
        conn.store.release(reserved)
        conn.server.memory_freed()
    conn.server.forbidden += 1
    if code in _KEYED_OPS:
        message = (f"{Op(code).name}: this connection's tenant token covers only keys starting "
                   f"{conn.scope.decode()!r}")
    else:
        message = f"{Op(code).name} needs the operator's token (a tenant token covers only its own keys)"
    conn.reply(Status.FORBIDDEN, request_id, message.encode())


def early_refusal(store: ByteStore, h: P.Header, scratch_bytes: int) -> tuple[Status, str] | None:
    """Returns (status, message) for an authenticated request refused before its body is
    received (unknown op, a body the memory budget can never hold), else None. A frame over
    `scratch_bytes` (the connection's receive buffer) needs budget for its own buffer."""
    if h.code not in _OPS:
        return Status.UNKNOWN_OP, f"unknown op {h.code}"
    if h.code == Op.PUT and not store.fits(h.key_len, h.payload_len):
        return Status.TOO_LARGE, f"entry of {h.body_len} bytes exceeds the server's memory budget"
    if h.code != Op.PUT and h.body_len > P.MAX_REQUEST_BODY:
        return (Status.TOO_LARGE,
                f"request body of {h.body_len} bytes exceeds {P.MAX_REQUEST_BODY} (only PUT may be larger)")
    if P.HEADER_SIZE + h.body_len > scratch_bytes and not store.fits(0, h.body_len):
        return Status.TOO_LARGE, f"request body of {h.body_len} bytes exceeds the server's memory budget"
    return None


def send_value(conn: HandlerConnection, request_id: int, key: bytes, value: P.Buffer) -> None:
    """Queues an OK reply carrying the stored `value` of `key`: sent from the store's buffer,
    pinned until written, when it is larger than INLINE_REPLY."""
    if len(value) <= INLINE_REPLY:
        conn.reply(Status.OK, request_id, value)
    else:
        conn.store.pin(key, value)
        conn.reply(Status.OK, request_id, value, pinned=True)


class ParkedGet:
    """A GET whose value is being read from the disk spill, parking its connection (no later
    request of it runs, so replies stay in order). It ends exactly once: answered with the
    value (or NOT_FOUND) when the read completes, or NOT_FOUND at its deadline
    (`answer_if_overdue`, --frame-timeout: Connection.check_deadlines), the read's late
    completion then ignored. The connection's `parked` is set while it lasts."""

    def __init__(self, conn: HandlerConnection, request_id: int, key: bytes) -> None:
        self.conn, self.request_id, self.key = conn, request_id, key
        self.since = conn.loop.time()

    @classmethod
    def start(cls, conn: HandlerConnection, request_id: int, key: bytes) -> None:
        """Answers a GET whose value is not in memory: parks `conn` while the value is read,
        or answers NOT_FOUND now if the spill does not hold it."""
        parked = cls(conn, request_id, key)
        if conn.store.load(key, parked._loaded):
            conn.parked = parked
        else:
            conn.reply(Status.NOT_FOUND, request_id)

    def answer_if_overdue(self, now: float, timeout: float) -> bool:
        """Answers NOT_FOUND and unparks the connection if the read ran past `timeout`
        seconds (the read goes on, its result dropped); returns whether it did."""
        if now - self.since <= timeout:
            return False
        self.conn.parked = None
        self.conn.reply(Status.NOT_FOUND, self.request_id)
        return True

    def _loaded(self, value: P.Buffer | None) -> None:
        conn = self.conn
        if conn.parked is not self:
            return  # answered at its deadline
        conn.parked = None
        if conn.closing:
            return
        if value is None:
            conn.reply(Status.NOT_FOUND, self.request_id)
        else:
            send_value(conn, self.request_id, self.key, value)
        conn.resume()
