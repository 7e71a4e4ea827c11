"""One self-describing stored value per chunk (DESIGN §3).

Layout: a fixed little-endian header, the shape, then the codec payload:

    magic "KVTC" | version u8 | codec u8 | dtype u8 | ndim u8 | reserved u32 | num_tokens u32 |
    payload_len u64 | key_tag u64 | checksum u64 | shape: ndim x u64 | payload

`checksum` is xxh3-64 over the header (with the checksum field zeroed) and the payload, so a
flipped byte anywhere or a truncated value fails `decode`. `key_tag` is xxh3-64 of the key the
value was stored under: a value copied under another key (foreign data) is refused too.
Decoding only reinterprets bytes as numbers; nothing is unpickled.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from kvstore.codecs import Buffer, Codec, CodecError, codec_by_id, get_codec

MAGIC = b"KVTC"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sBBBBIIQQQ")
_CHECKSUM_OFFSET = _HEADER.size - 8
_MAX_NDIM = 8

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
        return memoryview(out)


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
    header = bytearray(_HEADER.size + 8 * len(shape))
    _HEADER.pack_into(header, 0, MAGIC, FORMAT_VERSION, codec.codec_id, _DTYPES[kv.dtype], len(shape), 0,
                      num_tokens, payload.nbytes, key_tag(key), 0)
    struct.pack_into(f"<{len(shape)}Q", header, _HEADER.size, *shape)
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
    magic, version, codec_id, dtype_id, ndim, _, num_tokens, plen, _, _ = _HEADER.unpack_from(view, 0)
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
    hlen = _HEADER.size + 8 * ndim
    if len(view) < hlen:
        raise SerdeError("value truncated inside the header")
    shape = struct.unpack_from(f"<{ndim}Q", view, _HEADER.size)
    return ValueHeader(codec.name, _DTYPE_BY_ID[dtype_id], tuple(shape), num_tokens, plen, hlen)


def decode(key: str, value: Buffer) -> torch.Tensor:
    """Returns the CPU chunk stored in `value` under `key`.

    Raises SerdeError if the value is truncated, corrupt (checksum), stored under another key,
    or of an unknown format. The result may view `value`'s memory (raw codec): no copy.
    """
    header = read_header(value)
    if len(value) != header.header_len + header.payload_len:
        raise SerdeError(f"value is {len(value)} bytes, header says {header.header_len + header.payload_len}")
    tag, stored_sum = struct.unpack_from("<QQ", value, _CHECKSUM_OFFSET - 8)
    if tag != key_tag(key):
        raise SerdeError("value was stored under a different key")
    h = xxhash.xxh3_64()
    mv = memoryview(value)
    h.update(mv[:_CHECKSUM_OFFSET])
    h.update(b"\0" * 8)
    h.update(mv[_CHECKSUM_OFFSET + 8 :])
    if h.intdigest() != stored_sum:
        raise SerdeError("checksum mismatch: value is corrupt")
    payload = mv[header.header_len :]
    try:
        return get_codec(header.codec).decode(payload, header.dtype, header.shape)
    except CodecError as exc:
        raise SerdeError(f"payload does not decode: {exc}") from None
