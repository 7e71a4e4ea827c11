"""One self-describing stored value per chunk (docs/architecture.md, "Chunks, keys and codecs").

Layout: a fixed little-endian header, the shape, then the codec payload:

    magic "KVTC" | version u8 | codec u8 | dtype u8 | ndim u8 | flags u32 | num_tokens u32 |
    payload_len u64 | key_tag u64 | checksum u64 | shape: ndim x u64 | [mac: 32 bytes] | payload

`checksum` is xxh3-64 over the header (with the checksum field zeroed) and the payload, so a
flipped byte anywhere or a truncated value fails `decode`. `key_tag` is xxh3-64 of the key the
value was stored under: a value copied under another key (foreign data) is refused too.
Decoding only reinterprets bytes as numbers; nothing is unpickled.

Integrity (opt-in, `set_integrity_key`): a checksum catches corruption, not forgery (anyone can
re-encode other K/V with a valid checksum). With a shared secret set, every value carries a
keyed BLAKE3 MAC (flag bit 0) over the full key, the header and the payload, and `decode`
refuses a value whose MAC is missing or wrong. BLAKE3 because on one core it hashes K/V faster
than keyed BLAKE2b or HMAC-SHA256 (benchmarks/bench_store.py measures all three; the figures
are in docs/reliability.md). The secret is per process (one deployment, one key): readers
without it do not check MACs.
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np
import torch
import xxhash

from kvstore.codecs import Buffer, Codec, CodecError, codec_by_id, get_codec

MAGIC = b"KVTC"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sBBBBIIQQQ")
_CHECKSUM_OFFSET = _HEADER.size - 8
_MAX_NDIM = 8
FLAG_MAC = 1
MAC_LEN = 32
MAX_HEADER_LEN = _HEADER.size + 8 * _MAX_NDIM + MAC_LEN
"""The longest header a value can have: a prefix this long tells whether a value looks like a chunk."""
_KEY_CONTEXT = "kvtier 2026-11 stored K/V integrity v1"
_mac_key: bytes | None = None

_DTYPES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.uint8: 5,
    torch.int8: 6,
    torch.int32: 7,
    torch.int64: 8,
}
_DTYPE_BY_ID = {v: k for k, v in _DTYPES.items()}


class SerdeError(ValueError):
    """A stored value is corrupt, truncated, foreign or of an unknown format: treat it as a miss."""


@dataclass(frozen=True)
class ValueHeader:
    """What a stored value says about itself."""

    codec: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    num_tokens: int
    payload_len: int
    header_len: int
    has_mac: bool = False


def set_integrity_key(secret: str | bytes | None) -> None:
    """Sets (or, with None, removes) this process's K/V integrity secret: from now on values are
    encoded with a MAC and values without a valid one do not decode. Raises ValueError for a
    secret shorter than 16 bytes (too weak to be one)."""
    global _mac_key
    if secret is None:
        _mac_key = None
        return
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(raw) < 16:
        raise ValueError(f"integrity key: need at least 16 bytes of secret, got {len(raw)}")
    _mac_key = blake3.blake3(raw, derive_key_context=_KEY_CONTEXT).digest()


def integrity_enabled() -> bool:
    """Returns whether values are MAC'd and checked (an integrity key is set)."""
    return _mac_key is not None


def _mac_hasher(mac_key: bytes, key: str, header: Buffer) -> Any:
    """Returns a BLAKE3 hasher keyed for the MAC of a value stored under `key`, fed with the key
    and `header` (checksum and MAC zeroed): the payload is fed next."""
    kb = key.encode()
    h = blake3.blake3(key=mac_key)
    h.update(struct.pack("<I", len(kb)) + kb)
    h.update(header)
    return h


def _mac(mac_key: bytes, key: str, header: Buffer, payload: Buffer) -> bytes:
    """Returns the 32-byte MAC of a value stored under `key` (header with checksum and MAC zeroed)."""
    h = _mac_hasher(mac_key, key, header)
    h.update(payload)
    return bytes(h.digest())


def key_tag(key: str) -> int:
    """Returns the 64-bit tag of `key` recorded in values stored under it."""
    return xxhash.xxh3_64_intdigest(key.encode())


@dataclass(frozen=True)
class SplitValue:
    """A stored value as header + payload, not yet joined: tiers that can write the two parts
    separately (a file, a socket) skip the copy that joining costs."""

    header: bytes
    payload: memoryview

    @property
    def nbytes(self) -> int:
        return len(self.header) + self.payload.nbytes

    def __len__(self) -> int:
        return self.nbytes

    def join(self) -> memoryview:
        """Returns the value as one contiguous buffer (one copy)."""
        out = np.empty(self.nbytes, dtype=np.uint8)  # numpy: huge pages, see codecs.host_empty
        hlen = len(self.header)
        out[:hlen] = np.frombuffer(self.header, dtype=np.uint8)
        out[hlen:] = np.frombuffer(self.payload, dtype=np.uint8)
        return out.data


def encode_split(key: str, kv: torch.Tensor, codec: Codec | str = "raw", num_tokens: int | None = None) -> SplitValue:
    """Returns the value for chunk `kv` stored under `key` as header + payload (no copy of the
    payload for the raw codec: it views `kv`, which must not change until the value is written).

    `num_tokens` defaults to `kv.shape[2]` for `(layers, 2, tokens, heads, head_size)` chunks.
    Raises ValueError for an unsupported dtype or a tensor the codec cannot encode.
    """
    codec = get_codec(codec) if isinstance(codec, str) else codec
    if kv.dtype not in _DTYPES:
        raise ValueError(f"unsupported chunk dtype {kv.dtype}; supported: {sorted(map(str, _DTYPES))}")
    if kv.dim() > _MAX_NDIM:
        raise ValueError(f"chunk has {kv.dim()} dimensions, at most {_MAX_NDIM} are supported")
    if num_tokens is None:
        num_tokens = kv.shape[2] if kv.dim() == 5 else 0
    payload = memoryview(codec.encode(kv)).cast("B")
    shape = tuple(int(d) for d in kv.shape)
    mac_key = _mac_key  # one read: a concurrent set_integrity_key cannot split this value
    mac_len = MAC_LEN if mac_key is not None else 0
    header = bytearray(_HEADER.size + 8 * len(shape) + mac_len)
    _HEADER.pack_into(header, 0, MAGIC, FORMAT_VERSION, codec.codec_id, _DTYPES[kv.dtype], len(shape),
                      FLAG_MAC if mac_len else 0, num_tokens, payload.nbytes, key_tag(key), 0)
    struct.pack_into(f"<{len(shape)}Q", header, _HEADER.size, *shape)
    if mac_key is not None:
        header[-MAC_LEN:] = _mac(mac_key, key, header, payload)
    h = xxhash.xxh3_64(header)
    h.update(payload)
    struct.pack_into("<Q", header, _CHECKSUM_OFFSET, h.intdigest())
    return SplitValue(bytes(header), payload)


def encode(key: str, kv: torch.Tensor, codec: Codec | str = "raw", num_tokens: int | None = None) -> memoryview:
    """Returns one contiguous value (header + payload) for chunk `kv` stored under `key`
    (see `encode_split`); the payload is copied once."""
    return encode_split(key, kv, codec, num_tokens).join()


def read_header(value: Buffer) -> ValueHeader:
    """Returns the parsed header of `value` without checking the payload; raises SerdeError."""
    view = memoryview(value).cast("B") if not isinstance(value, (bytes, bytearray)) else value
    if len(view) < _HEADER.size:
        raise SerdeError(f"value of {len(view)} bytes is shorter than the header")
    magic, version, codec_id, dtype_id, ndim, flags, num_tokens, plen, _, _ = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise SerdeError("bad magic: not a kvtier chunk")
    if version != FORMAT_VERSION:
        raise SerdeError(f"unknown format version {version}")
    if dtype_id not in _DTYPE_BY_ID or ndim > _MAX_NDIM:
        raise SerdeError("unknown dtype or bad rank in header")
    try:
        codec = codec_by_id(codec_id)
    except CodecError as exc:
        raise SerdeError(str(exc)) from None
    if flags & ~FLAG_MAC:
        raise SerdeError(f"unknown header flags {flags:#x}")
    hlen = _HEADER.size + 8 * ndim + (MAC_LEN if flags & FLAG_MAC else 0)
    if len(view) < hlen:
        raise SerdeError("value truncated inside the header")
    shape = struct.unpack_from(f"<{ndim}Q", view, _HEADER.size)
    return ValueHeader(codec.name, _DTYPE_BY_ID[dtype_id], tuple(shape), num_tokens, plen, hlen,
                       bool(flags & FLAG_MAC))


def looks_like_value(prefix: Buffer) -> bool:
    """Returns whether `prefix` (the first MAX_HEADER_LEN bytes of a value, or all of a shorter
    one) parses as a chunk header: a cheap existence check that rejects garbage."""
    try:
        read_header(prefix)
    except SerdeError:
        return False
    return True


CHECK_PIECE = 512 << 10
"""Bytes a tier reads or receives at a time into a value it checks as it arrives (`ValueCheck`):
each piece is hashed while still in the CPU's cache (half of one core's L2 here), not read back
from memory by a second pass."""


class ValueCheck:
    """The checksum and (with an integrity key) the MAC of a value stored under `key`, computed
    from its bytes as they arrive: a tier that reads a value in pieces feeds each piece while it
    is still in the CPU's cache instead of reading the whole value again to check it.

    `feed` takes the value's bytes in order, the first piece holding at least its header
    (`MAX_HEADER_LEN` bytes, or the whole value if shorter); it never raises: a bad header is
    remembered and `decode` raises it."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._header: ValueHeader | None = None
        self._error: SerdeError | None = None
        self._stored_sum = 0
        self._stored_mac = b""
        self._sum = xxhash.xxh3_64()
        self._mac: Any = None  # blake3 hasher when a MAC is checked
        self._fed = 0

    def feed(self, piece: Buffer) -> None:
        """Adds the value's next `piece` (its bytes are not kept)."""
        if self._error is not None:
            return
        mv = memoryview(piece).cast("B")
        if self._header is None:
            try:
                mv = self._start(mv)
            except SerdeError as exc:
                self._error = exc
                return
        self._sum.update(mv)
        if self._mac is not None:
            self._mac.update(mv)
        self._fed += mv.nbytes

    def arrived(self, value: memoryview, upto: int) -> None:
        """Feeds the bytes of `value[:upto]` not fed yet: a receiver calls it each time more of
        the value's buffer `value` (its whole length) has arrived. Nothing is fed before the
        header has arrived (MAX_HEADER_LEN bytes, or all of a shorter value)."""
        if upto > self._fed and (self._fed or upto >= min(len(value), MAX_HEADER_LEN)):
            self.feed(value[self._fed:upto])

    def _start(self, first: memoryview) -> memoryview:
        """Checks the header in `first`, hashes it; returns the rest of `first` (payload)."""
        header = read_header(first)
        tag, self._stored_sum = struct.unpack_from("<QQ", first, _CHECKSUM_OFFSET - 8)
        if tag != key_tag(self.key):
            raise SerdeError("value was stored under a different key")
        hlen = header.header_len
        self._sum.update(first[:_CHECKSUM_OFFSET])
        self._sum.update(bytes(8))
        self._sum.update(first[_CHECKSUM_OFFSET + 8 : hlen])
        mac_key = _mac_key  # one read: a concurrent set_integrity_key cannot split this check
        if mac_key is not None:
            if not header.has_mac:
                raise SerdeError("value carries no MAC and an integrity key is set: refused")
            unsigned = bytearray(first[:hlen])
            self._stored_mac = bytes(unsigned[-MAC_LEN:])
            unsigned[_CHECKSUM_OFFSET : _CHECKSUM_OFFSET + 8] = bytes(8)
            unsigned[-MAC_LEN:] = bytes(MAC_LEN)
            self._mac = _mac_hasher(mac_key, self.key, unsigned)
        self._header = header
        self._fed = hlen
        return first[hlen:]

    def verify(self, nbytes: int) -> ValueHeader:
        """Returns the header of the `nbytes`-byte value that was fed, once its bytes are
        whole and check out. Raises SerdeError if the value is truncated, corrupt (checksum),
        stored under another key, of an unknown format, or (with an integrity key set) lacks
        a valid MAC."""
        if self._error is not None:
            raise self._error
        header = self._header
        if header is None:
            raise SerdeError("value is empty")
        if nbytes != header.header_len + header.payload_len:
            raise SerdeError(f"value is {nbytes} bytes, header says {header.header_len + header.payload_len}")
        if self._fed != nbytes:
            raise SerdeError(f"checked {self._fed} bytes of a {nbytes}-byte value")
        if self._sum.intdigest() != self._stored_sum:
            raise SerdeError("checksum mismatch: value is corrupt")
        if self._mac is not None and not hmac.compare_digest(self._stored_mac, self._mac.digest()):
            raise SerdeError("MAC mismatch: value was not written with this integrity key")
        return header

    def decode(self, value: Buffer) -> torch.Tensor:
        """Returns the chunk in `value`, the bytes that were fed (refused as by `verify`, with
        SerdeError). The result may view `value`'s memory (raw codec): no copy."""
        header = self.verify(len(value))
        try:
            return get_codec(header.codec).decode(memoryview(value)[header.header_len :], header.dtype, header.shape)
        except CodecError as exc:
            raise SerdeError(f"payload does not decode: {exc}") from None


@dataclass(frozen=True)
class CheckedValue:
    """A value read together with its `ValueCheck`, fed with all of its bytes as they were read."""

    value: Buffer
    check: ValueCheck

    def __len__(self) -> int:
        return len(self.value)


def decode(key: str, value: Buffer | CheckedValue) -> torch.Tensor:
    """Returns the CPU chunk stored in `value` under `key` (see `ValueCheck.decode` for what is
    refused, with SerdeError). A `CheckedValue` is not hashed again; its check must be for `key`."""
    if isinstance(value, CheckedValue):
        if value.check.key != key:
            raise SerdeError("value was checked for a different key")
        return value.check.decode(value.value)
    check = ValueCheck(key)
    check.feed(value)
    return check.decode(value)
