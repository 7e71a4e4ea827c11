"""Self-describing values and codecs: exact round trips, bounded lossy error, corruption = miss."""

from __future__ import annotations

import random

import pytest
import torch

from kvstore import serde
from kvstore.codecs import CodecError, QuantCodec, get_codec

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def kv_chunk(dtype: torch.dtype = torch.float16, tokens: int = 64, seed: int = 0) -> torch.Tensor:
    """A KV-like chunk: keys with a few outlier channels (as real keys have), values plain."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(4, 2, tokens, 3, 64, generator=g)
    kv[:, 0, :, :, 5] *= 20.0
    return kv.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", ["raw", "lz4"])
def test_lossless_round_trip(codec: str, dtype: torch.dtype) -> None:
    kv = kv_chunk(dtype)
    value = serde.encode("k", kv, codec)
    out = serde.decode("k", bytes(value))
    assert out.dtype == dtype and out.shape == kv.shape
    assert torch.equal(out, kv)
    header = serde.read_header(value)
    assert (header.codec, header.num_tokens, header.shape) == (codec, 64, tuple(kv.shape))


def test_lossless_handles_odd_shapes_and_short_chunks() -> None:
    for kv in (torch.randn(3, 2, 1, 3, 64), torch.randn(7).half(), torch.arange(10, dtype=torch.int64)):
        for codec in ("raw", "lz4"):
            assert torch.equal(serde.decode("k", serde.encode("k", kv, codec)), kv)


def test_lz4_shuffle_compresses_real_looking_fp16() -> None:
    # smooth, low-entropy data: shuffling puts exponent bytes together, which lz4 can use
    kv = (torch.linspace(0, 1, 4 * 2 * 64 * 3 * 64).reshape(4, 2, 64, 3, 64)).half()
    assert len(serde.encode("k", kv, "lz4")) < 0.8 * len(serde.encode("k", kv, "raw"))


def test_lz4_decodes_back_to_back_chunks_through_reused_buffers() -> None:
    # the second decode reuses the first one's scratch buffer: stale bytes must not leak through
    codec = get_codec("lz4")
    a, b = kv_chunk(torch.float32, seed=1), kv_chunk(torch.float32, seed=2)
    pa, pb = bytes(codec.encode(a)), bytes(codec.encode(b))
    out_a = codec.decode(pa, a.dtype, tuple(a.shape))
    assert torch.equal(codec.decode(pb, b.dtype, tuple(b.shape)), b)
    assert torch.equal(out_a, a)


def test_lz4_refuses_payloads_that_do_not_hold_their_shape() -> None:
    # a forged value can carry a valid checksum: the codec itself must refuse what does not fit
    codec = get_codec("lz4")
    kv = kv_chunk(torch.float16, tokens=16)
    shape = tuple(kv.shape)
    payload = bytes(codec.encode(kv))
    cases = {
        "another shape": (payload, (4, 2, 8, 3, 64)),
        "a huge forged shape": (payload, (1 << 20, 1 << 20)),
        "a truncated block": (payload[:-10], shape),
        "garbage after the size": (payload[:4] + bytes(range(256)) * 8, shape),
        "no size": (payload[:2], shape),
    }
    for name, (bad, bad_shape) in cases.items():
        with pytest.raises(CodecError):
            codec.decode(bad, kv.dtype, bad_shape)
            pytest.fail(f"{name} decoded")


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantised_error_is_bounded(bits: int, dtype: torch.dtype) -> None:
    kv = kv_chunk(dtype, tokens=256)
    out = serde.decode("k", serde.encode("k", kv, f"int{bits}"))
    assert out.dtype == dtype and out.shape == kv.shape
    x = kv.float()
    qmax = (1 << bits) - 1
    # keys per channel (range over tokens), values per token (range over head_size)
    k_scale = (x[:, 0].amax(1, keepdim=True) - x[:, 0].amin(1, keepdim=True)) / qmax
    v_scale = (x[:, 1].amax(3, keepdim=True) - x[:, 1].amin(3, keepdim=True)) / qmax
    # scale/2 from rounding, plus fp16 storage of min/scale and the output dtype's rounding
    slack = 2 ** -9 if dtype == torch.bfloat16 else 2 ** -10
    k_err = (out.float()[:, 0] - x[:, 0]).abs()
    v_err = (out.float()[:, 1] - x[:, 1]).abs()
    assert (k_err <= 0.5 * k_scale * 1.01 + slack * (x[:, 0].abs() + k_scale * qmax) + 1e-6).all()
    assert (v_err <= 0.5 * v_scale * 1.01 + slack * (x[:, 1].abs() + v_scale * qmax) + 1e-6).all()
    rel = (out.float() - x).norm() / x.norm()
    assert rel < (0.01 if bits == 8 else 0.15), f"int{bits} relative error {rel:.4f}"


def test_int8_is_at_least_1_9x_smaller_than_fp16() -> None:
    kv = kv_chunk(torch.float16, tokens=256)
    raw, q8, q4 = (len(serde.encode("k", kv, c)) for c in ("raw", "int8", "int4"))
    assert raw / q8 >= 1.9
    assert raw / q4 >= 3.5


def test_quant_codec_rejects_non_chunk_shapes() -> None:
    with pytest.raises(ValueError, match="layers, 2, tokens"):
        serde.encode("k", torch.randn(10, 4), "int8")
    with pytest.raises(ValueError, match="floating-point"):
        serde.encode("k", torch.zeros(1, 2, 4, 1, 8, dtype=torch.int32), "int8")
    with pytest.raises(ValueError, match="bits"):
        QuantCodec(3)
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("zstd")


@pytest.mark.parametrize("codec", ["raw", "lz4", "int8", "int4"])
def test_every_flipped_byte_and_truncation_is_detected(codec: str) -> None:
    kv = kv_chunk(torch.float16, tokens=16)
    value = bytes(serde.encode("k", kv, codec))
    rng = random.Random(0)
    positions = list(range(0, 96)) + rng.sample(range(96, len(value)), 200)  # whole header + payload samples
    for pos in positions:
        bad = bytearray(value)
        bad[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(serde.SerdeError):
            serde.decode("k", bytes(bad))
    for cut in (0, 3, 20, 60, len(value) // 2, len(value) - 1):
        with pytest.raises(serde.SerdeError):
            serde.decode("k", value[:cut])
    with pytest.raises(serde.SerdeError):
        serde.decode("k", value + b"\0")


def test_foreign_values_are_refused() -> None:
    kv = kv_chunk(torch.float16, tokens=16)
    value = bytes(serde.encode("key-a", kv))
    with pytest.raises(serde.SerdeError, match="different key"):
        serde.decode("key-b", value)
    with pytest.raises(serde.SerdeError, match="magic"):
        serde.decode("key-a", b"\x80\x04\x95" + value[3:])  # a pickle header is not a chunk
    with pytest.raises(serde.SerdeError):
        serde.decode("key-a", b"")
