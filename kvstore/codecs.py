"""Payload codecs for one KV chunk (docs/architecture.md, "Chunks, keys and codecs").

A codec turns a tensor into payload bytes and back, given the dtype and shape the serde header
records. `raw` and `lz4` are exact; `int8` and `int4` are lossy KIVI-style quantisers (keys per
channel, values per token) and are opt-in. Nothing here unpickles: decoding only reinterprets
bytes as numbers.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod

import cramjam
import numpy as np
import torch

from kvstore.read_buffers import ReadBufferPool

Buffer = bytes | bytearray | memoryview

# Decoded chunks view the received value (a `bytes` from Redis) without copying it; nothing
# else references those bytes, so torch's "not writable" warning is noise here. torch emits it
# once per process: spend that once here, silenced, instead of in some caller's first get.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)


class CodecError(ValueError):
    """A payload does not decode to the recorded dtype/shape (corrupt or foreign)."""


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Returns an uninitialised CPU tensor whose memory numpy allocated.

    numpy asks for transparent huge pages on large allocations and torch's CPU allocator does
    not; for multi-MB chunks the page faults of a fresh torch buffer cost more than the copy.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return torch.from_numpy(np.empty(numel * itemsize, dtype=np.uint8)).view(dtype).reshape(shape)


def host_copy(kv: torch.Tensor) -> torch.Tensor:
    """Returns a contiguous CPU copy of `kv`, copied by numpy when `kv` is a contiguous CPU
    tensor: one single-threaded memcpy into a huge-page buffer. torch's copy splits the work
    over its intra-op threads, which on a busy host can be several times slower than memcpy."""
    t = kv.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        return host_empty(tuple(t.shape), t.dtype).copy_(t)
    raw = np.frombuffer(tensor_bytes(t), dtype=np.uint8).copy()
    return torch.from_numpy(raw).view(t.dtype).reshape(t.shape)


def tensor_bytes(kv: torch.Tensor) -> memoryview:
    """Returns a flat uint8 view of `kv` on the CPU (zero-copy when already contiguous on CPU)."""
    t = kv.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1).view(torch.uint8)
    return t.numpy().data.cast("B")


def tensor_from_bytes(buf: Buffer, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Returns a CPU tensor viewing `buf` (no copy). Raises CodecError if the sizes disagree."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if len(buf) != numel * itemsize:
        raise CodecError(f"payload has {len(buf)} bytes, {dtype}{tuple(shape)} needs {numel * itemsize}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


class Codec(ABC):
    """Encodes a chunk tensor to payload bytes and decodes it back."""

    name: str
    codec_id: int
    lossless: bool = True

    @abstractmethod
    def encode(self, kv: torch.Tensor) -> Buffer:
        """Returns the payload for `kv` (may be a view of `kv`'s memory; do not mutate kv meanwhile)."""

    @abstractmethod
    def decode(self, payload: Buffer, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Returns a CPU tensor of `dtype`/`shape`; raises CodecError if the payload does not fit."""


class RawCodec(Codec):
    """The tensor's bytes as they are: exact and zero-copy in both directions."""

    name, codec_id = "raw", 0

    def encode(self, kv: torch.Tensor) -> Buffer:
        return tensor_bytes(kv)

    def decode(self, payload: Buffer, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return tensor_from_bytes(payload, dtype, shape)


# Shuffled bytes between decompression and unshuffle (one chunk per decoding thread at a time).
_SHUFFLED = ReadBufferPool(max_free_bytes=64 << 20)


class LZ4Codec(Codec):
    """Byte-shuffle, then lz4. Exact. Shuffling groups the i-th byte of every element together
    (sign/exponent bytes compress well; mantissa bytes do not), which is what makes lz4 worth
    anything on float KV: unshuffled fp16 KV barely compresses.

    Payload: the shuffled bytes' length (u32, little-endian), then one LZ4 block (python-lz4's
    `store_size=True` layout). cramjam decompresses into a reused buffer: into fresh memory
    from the allocator, every 4 KiB page faults, which costs several times the decompression."""

    name, codec_id = "lz4", 1
    # LZ4's longest match is 255 bytes per input byte: no valid block expands further.
    _MAX_RATIO = 255

    def encode(self, kv: torch.Tensor) -> Buffer:
        itemsize = kv.element_size()
        raw = np.frombuffer(tensor_bytes(kv), dtype=np.uint8)
        shuffled = np.ascontiguousarray(raw.reshape(-1, itemsize).T)
        return memoryview(cramjam.lz4.compress_block(shuffled.data, mode="fast", acceleration=1, store_size=True))

    def decode(self, payload: Buffer, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        view = memoryview(payload).cast("B")
        if view.nbytes < 4 or int.from_bytes(view[:4], "little") != nbytes:
            raise CodecError(f"lz4 payload does not hold the {nbytes} bytes its header records")
        if nbytes > self._MAX_RATIO * view.nbytes:  # a forged shape: refused before allocating
            raise CodecError(f"lz4 payload of {view.nbytes} bytes cannot hold {nbytes}")
        shuffled = _SHUFFLED.take(nbytes)
        try:
            got = cramjam.lz4.decompress_block_into(view, shuffled)
        except Exception as exc:  # cramjam raises DecompressionError on garbage
            raise CodecError(f"lz4 payload does not decompress: {exc}") from None
        if got != nbytes:
            raise CodecError(f"lz4 payload decompressed to {got} bytes, not {nbytes}")
        # One strided copy per byte plane into a huge-page buffer: several times faster than
        # numpy's transpose copy of the whole (itemsize, n) matrix.
        planes = np.frombuffer(shuffled, dtype=np.uint8).reshape(itemsize, -1)
        out = np.empty((planes.shape[1], itemsize), dtype=np.uint8)
        for i in range(itemsize):
            out[:, i] = planes[i]
        return tensor_from_bytes(out.reshape(-1).data, dtype, shape)


class QuantCodec(Codec):
    """KIVI-style asymmetric quantisation of a `(layers, 2, tokens, kv_heads, head_size)` chunk.

    Keys are quantised per channel (min/scale over the tokens of each layer/head/dim: key
    outliers live in fixed channels), values per token (over head_size). Min and scale are
    stored as fp16 after the codes, so int8 is about 1.93x smaller than fp16 at 256 tokens.
    Per element the error is at most scale/2 plus the fp16 rounding of the group minimum.
    """

    lossless = False

    def __init__(self, bits: int) -> None:
        if bits not in (4, 8):
            raise ValueError(f"quantisation bits must be 4 or 8, got {bits}")
        self.bits = bits
        self.qmax = (1 << bits) - 1
        self.name = f"int{bits}"
        self.codec_id = 2 if bits == 8 else 3

    def _check_shape(self, shape: tuple[int, ...]) -> None:
        if len(shape) != 5 or shape[1] != 2:
            raise CodecError(
                f"{self.name} codec needs a (layers, 2, tokens, heads, head_size) chunk, got {tuple(shape)}"
            )

    def _quantise(self, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lo = x.amin(dim=dim, keepdim=True).to(torch.float16)
        hi = x.amax(dim=dim, keepdim=True)
        scale = ((hi - lo.float()) / self.qmax).to(torch.float16)
        if not (torch.isfinite(lo).all() and torch.isfinite(scale).all()):
            raise ValueError(f"{self.name} codec: chunk has values outside the fp16 range")
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        # in place after the first op: one temporary for the whole chunk
        q = (x - lo.float()).mul_(scale.float().reciprocal()).round_().clamp_(0, self.qmax).to(torch.uint8)
        return q, lo, scale

    def _pack(self, q: torch.Tensor) -> np.ndarray:
        codes = q.reshape(-1).numpy()
        if self.bits == 8:
            return codes
        if codes.size % 2:
            codes = np.append(codes, np.uint8(0))
        return (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)

    def _unpack(self, packed: np.ndarray, n: int) -> torch.Tensor:
        """Returns the n codes as float32 (a fresh, writable array)."""
        if self.bits == 8:
            return torch.from_numpy(packed.astype(np.float32))
        out = np.empty(packed.size * 2, dtype=np.float32)
        out[0::2] = packed & 0x0F
        out[1::2] = packed >> 4
        return torch.from_numpy(out[:n])

    def _layout(self, shape: tuple[int, ...]) -> list[int]:
        """Returns the byte sizes of: key codes, value codes, key min, key scale, value min, value scale."""
        layers, _, tokens, heads, dim = shape
        n = layers * tokens * heads * dim
        code_bytes = n if self.bits == 8 else (n + 1) // 2
        k_groups, v_groups = layers * heads * dim, layers * tokens * heads
        return [code_bytes, code_bytes, 2 * k_groups, 2 * k_groups, 2 * v_groups, 2 * v_groups]

    def encode(self, kv: torch.Tensor) -> Buffer:
        self._check_shape(tuple(kv.shape))
        if not kv.is_floating_point():
            raise ValueError(f"{self.name} codec needs a floating-point chunk, got {kv.dtype}")
        x = kv.detach().to("cpu", torch.float32)
        qk, k_lo, k_scale = self._quantise(x[:, 0], dim=1)  # per channel: over tokens
        qv, v_lo, v_scale = self._quantise(x[:, 1], dim=3)  # per token: over head_size
        parts = [self._pack(qk), self._pack(qv)] + [
            t.contiguous().view(torch.uint8).reshape(-1).numpy() for t in (k_lo, k_scale, v_lo, v_scale)
        ]
        return np.concatenate(parts).data

    def decode(self, payload: Buffer, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        self._check_shape(shape)
        sizes = self._layout(shape)
        if len(payload) != sum(sizes):
            raise CodecError(f"{self.name} payload has {len(payload)} bytes, {tuple(shape)} needs {sum(sizes)}")
        layers, _, tokens, heads, dim = shape
        arr = np.frombuffer(payload, dtype=np.uint8)
        bounds = np.cumsum([0] + sizes)
        seg = [arr[bounds[i] : bounds[i + 1]] for i in range(6)]
        n = layers * tokens * heads * dim

        def halfs(a: np.ndarray, s: tuple[int, ...]) -> torch.Tensor:
            return torch.from_numpy(a.copy()).view(torch.float16).float().reshape(s)

        k_shape, v_shape = (layers, 1, heads, dim), (layers, tokens, heads, 1)
        k = self._unpack(seg[0], n).reshape(layers, tokens, heads, dim)
        v = self._unpack(seg[1], n).reshape(layers, tokens, heads, dim)
        out = torch.empty((layers, 2, tokens, heads, dim), dtype=dtype)
        out[:, 0] = k.mul_(halfs(seg[3], k_shape)).add_(halfs(seg[2], k_shape))
        out[:, 1] = v.mul_(halfs(seg[5], v_shape)).add_(halfs(seg[4], v_shape))
        return out


_CODECS: dict[str, Codec] = {c.name: c for c in (RawCodec(), LZ4Codec(), QuantCodec(8), QuantCodec(4))}
_BY_ID: dict[int, Codec] = {c.codec_id: c for c in _CODECS.values()}


def get_codec(name: str) -> Codec:
    """Returns the codec called `name`; raises ValueError naming the valid choices."""
    try:
        return _CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; choose one of {sorted(_CODECS)}") from None


def codec_by_id(codec_id: int) -> Codec:
    """Returns the codec with header id `codec_id`; raises CodecError for an unknown id."""
    try:
        return _BY_ID[codec_id]
    except KeyError:
        raise CodecError(f"unknown codec id {codec_id}") from None


CODEC_NAMES: tuple[str, ...] = tuple(_CODECS)
