"""The cache server's wire protocol: fixed 24-byte frame headers, pure encode/decode.

Every request and every reply is one frame: a header, then `key_len` key bytes, then
`payload_len` payload bytes. Requests carry an op in the `code` byte, replies a status.
See docs/protocol.md for the full specification; this module is its one implementation.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from enum import IntEnum
from typing import NamedTuple

MAGIC = b"KVTS"
VERSION = 1
# magic, version, code (op or status), flags, request id, key length, payload length
HEADER = struct.Struct("<4sBBHIIQ")
HEADER_SIZE = HEADER.size  # 24
_unpack_header = HEADER.unpack_from
MAX_KEY_LEN = 4096
DEFAULT_MAX_PAYLOAD = 512 << 20
# Bodies of requests other than PUT (key lists): 16 MiB holds ~150k keys. A longer one is
# refused from its header, so no request but a PUT makes the server buffer MBs per connection.
MAX_REQUEST_BODY = 16 << 20
# Keys one PREFIX_HITS may carry: the work of one request on the server's event loop is
# bounded (4096 chunks of 256 tokens cover a 1M-token prompt; the client splits longer lists).
MAX_KEYS_PER_REQUEST = 4096
Buffer = bytes | bytearray | memoryview
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class Op(IntEnum):
    PING = 1
    AUTH = 2
    PUT = 3
    GET = 4
    EXISTS = 5
    PREFIX_HITS = 6
    DELETE = 7
    CLEAR = 8
    STATS = 9
    DELETE_PREFIX = 10  # removes every key starting with the request's key; replies the count
    SET_BUDGET = 11  # the operator's: sets the memory budget and/or tenant quota; replies STATS
    PIN = 12  # payload: u64 ttl in ms (0: until unpinned), then a key list; replies the bytes newly pinned
    UNPIN = 13  # payload: a key list; replies how many were pinned
    DESCRIBE = 14  # payload: a key list; replies JSON, per key its bytes and pin (null: not held)
    USAGE = 15  # key: a prefix (empty: all); replies JSON, per (tenant, key family) of its chunks entries and bytes
    DELETE_IDLE = 16  # the operator's; payload: u64 ms; removes chunks unused that long; replies the count


class Status(IntEnum):
    OK = 0
    NOT_FOUND = 1
    BAD_FRAME = 2  # bad magic/version/lengths: the server closes the connection after it
    UNKNOWN_OP = 3
    TOO_LARGE = 4  # a value larger than the server's whole memory budget
    AUTH_REQUIRED = 5
    AUTH_FAILED = 6
    BAD_REQUEST = 7  # well-framed but invalid (e.g. a malformed key list)
    # 8 is reserved (docs/protocol.md): never sent
    BUSY = 9  # the memory budget is held by other bodies in flight and replies: retry later
    TOO_MANY_CONNECTIONS = 10  # --max-connections reached: the server closes at once
    FORBIDDEN = 11  # a tenant token's connection named a key outside its tenant, or an operator's op
    PIN_REFUSED = 12  # a PIN over the pin budget, or naming a key not held: nothing was pinned


def empty_buffer(n: int) -> memoryview:
    """Returns a writable n-byte buffer to receive a payload into (the one place payload
    buffers are allocated). A plain bytearray: numpy.empty was tried and measured slower on
    multi-MB GETs here (its huge-page faults), despite skipping the zero-fill."""
    return memoryview(bytearray(n))


class ProtocolError(ValueError):
    """A frame that violates the protocol; the message names the problem."""


class Header(NamedTuple):
    """A decoded frame header (a NamedTuple: built once per frame on the hot path)."""

    code: int
    request_id: int
    key_len: int
    payload_len: int
    flags: int = 0

    @property
    def body_len(self) -> int:
        return self.key_len + self.payload_len


def encode_header(code: int, request_id: int, key_len: int, payload_len: int, flags: int = 0) -> bytes:
    """Returns the 24-byte header for one frame."""
    return HEADER.pack(MAGIC, VERSION, code, flags, request_id & 0xFFFFFFFF, key_len, payload_len)


def decode_header(buf: Buffer, max_payload: int, offset: int = 0) -> Header:
    """Returns the header at `offset` in `buf` (at least HEADER_SIZE bytes from there).

    Raises ProtocolError for a bad magic, an unsupported version, a key longer than
    MAX_KEY_LEN or a payload longer than `max_payload`; the code byte is not checked here
    (an unknown op is well-framed and gets its own status).
    """
    magic, version, code, flags, request_id, key_len, payload_len = _unpack_header(buf, offset)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this server speaks {VERSION})")
    if key_len > MAX_KEY_LEN:
        raise ProtocolError(f"key length {key_len} exceeds the limit of {MAX_KEY_LEN} bytes")
    if payload_len > max_payload:
        raise ProtocolError(f"payload length {payload_len} exceeds the limit of {max_payload} bytes")
    return Header(code, request_id, key_len, payload_len, flags)


def encode_frame(code: int, request_id: int, key: bytes = b"", payload: bytes = b"") -> bytes:
    """Returns one whole frame as bytes (for small frames; large payloads are sent separately)."""
    return encode_header(code, request_id, len(key), len(payload)) + key + payload


def encode_key_list(keys: Iterable[bytes]) -> bytes:
    """Returns the PREFIX_HITS payload: each key as a u32 length followed by its bytes."""
    parts: list[bytes] = []
    for key in keys:
        if len(key) > MAX_KEY_LEN:
            raise ProtocolError(f"key length {len(key)} exceeds the limit of {MAX_KEY_LEN} bytes")
        parts.append(_U32.pack(len(key)))
        parts.append(key)
    return b"".join(parts)


def decode_key_list(payload: Buffer, max_keys: int = MAX_KEYS_PER_REQUEST) -> list[bytes]:
    """Returns the keys of a PREFIX_HITS payload; raises ProtocolError if it is malformed or
    holds more than `max_keys` keys (found after decoding at most that many)."""
    view = memoryview(payload)
    keys: list[bytes] = []
    pos, end = 0, len(view)
    while pos < end:
        if len(keys) == max_keys:
            raise ProtocolError(f"key list holds more than {max_keys} keys (split it into several requests)")
        if end - pos < 4:
            raise ProtocolError("key list truncated inside a length prefix")
        (n,) = _U32.unpack_from(view, pos)
        pos += 4
        if n > MAX_KEY_LEN:
            raise ProtocolError(f"key length {n} exceeds the limit of {MAX_KEY_LEN} bytes")
        if pos + n > end:
            raise ProtocolError("key list truncated inside a key")
        keys.append(bytes(view[pos : pos + n]))
        pos += n
    return keys


def encode_pin(ttl_s: float | None, keys: Iterable[bytes]) -> bytes:
    """Returns a PIN payload: the ttl in whole milliseconds (at least 1; 0: until unpinned),
    then the key list."""
    ttl_ms = 0 if ttl_s is None else max(1, round(ttl_s * 1000))
    return _U64.pack(ttl_ms) + encode_key_list(keys)


def decode_pin(payload: Buffer) -> tuple[float | None, list[bytes]]:
    """Returns (ttl in seconds or None, keys) of a PIN payload; ProtocolError if malformed."""
    if len(payload) < 8:
        raise ProtocolError("PIN payload must start with a u64 ttl in milliseconds")
    (ttl_ms,) = _U64.unpack_from(payload, 0)
    return (ttl_ms / 1000 if ttl_ms else None), decode_key_list(memoryview(payload)[8:])


def encode_count(n: int) -> bytes:
    """Returns a u64 count payload (PREFIX_HITS replies)."""
    return _U64.pack(n)


def decode_count(payload: Buffer) -> int:
    """Returns the u64 count in a reply payload; raises ProtocolError if it is not 8 bytes."""
    if len(payload) != 8:
        raise ProtocolError(f"count payload must be 8 bytes, got {len(payload)}")
    return _U64.unpack(payload)[0]


MAX_USAGE_GROUPS = 4096
"""The most (tenant, key family) groups a USAGE reply carries: more is refused (TOO_LARGE), never
a reply of unbounded size."""


def encode_usage(groups: dict[tuple[str | None, str], tuple[int, int]]) -> bytes:
    """Returns a USAGE reply payload: a JSON list of [tenant or null, family, entries, bytes]."""
    return json.dumps([[t, f, n, b] for (t, f), (n, b) in sorted(groups.items(), key=str)]).encode()


def decode_usage(payload: Buffer) -> dict[tuple[str | None, str], tuple[int, int]]:
    """Returns the groups of a USAGE reply; raises ProtocolError when it is malformed."""
    try:
        rows = json.loads(bytes(payload))
        out = {(t, f): (int(n), int(b)) for t, f, n, b in rows
               if (t is None or isinstance(t, str)) and isinstance(f, str)}
    except (ValueError, TypeError, RecursionError):
        raise ProtocolError("USAGE reply is not a list of [tenant, family, entries, bytes]") from None
    if len(out) != len(rows):
        raise ProtocolError("USAGE reply names a group that is not (tenant, family) strings")
    return out


LIMITS = ("max_bytes", "tenant_quota")
"""What a SET_BUDGET payload may set (a JSON object of byte counts; absent or null: unchanged)."""


def encode_limits(max_bytes: int | None = None, tenant_quota: int | None = None) -> bytes:
    """Returns the SET_BUDGET payload setting the limits given (None: unchanged)."""
    given = {"max_bytes": max_bytes, "tenant_quota": tenant_quota}
    return json.dumps({k: v for k, v in given.items() if v is not None}).encode()


def decode_limits(payload: Buffer) -> dict[str, int | None]:
    """Returns the limits a SET_BUDGET payload sets (`LIMITS`, None: unchanged); raises
    ProtocolError naming the problem (not a JSON object, an unknown field, not a byte count)."""
    if len(payload) > 1024:
        raise ProtocolError(f"SET_BUDGET payload of {len(payload)} bytes is over 1024 (two byte counts)")
    try:
        data = json.loads(bytes(payload))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise ProtocolError("SET_BUDGET payload is not JSON") from None
    if not isinstance(data, dict):
        raise ProtocolError("SET_BUDGET payload must be a JSON object")
    unknown = sorted(set(data) - set(LIMITS))
    if unknown:
        raise ProtocolError(f"SET_BUDGET: unknown field(s) {unknown}; it sets {', '.join(LIMITS)}")
    out: dict[str, int | None] = {}
    for name in LIMITS:
        value = data.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ProtocolError(f"SET_BUDGET: {name} must be a byte count >= 0, got {value!r}")
        out[name] = value
    if out["max_bytes"] is None and out["tenant_quota"] is None:
        raise ProtocolError(f"SET_BUDGET sets nothing: give {' and/or '.join(LIMITS)}")
    return out
