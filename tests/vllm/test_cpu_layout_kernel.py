"""kvtier's CPU layouts against vLLM's own CPU attention kernels: each decoder reads exactly
what `cpu_attn_reshape_and_cache` writes for its kernels ("vec", "vec16", "amx"), it scatters
the bytes that op would have written, a tile's bytes depend only on its tokens (so tiles move
between blocks, caches and instances), and vLLM's attention (`cpu_attention_with_kv_cache`)
over K/V a layout scattered equals attention computed from those K/V directly. The cache-
writing op is plain C++ for every ISA, run wherever vLLM's CPU library has that ISA compiled in
("amx": the library it loads on CPUs with AVX512-BF16); the attention kernels of an ISA run only
where the CPU has its instructions. Runs in vLLM's virtualenv only (`make test-vllm`)."""

from __future__ import annotations

import math

import pytest
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from connector.vllm.layouts import (
    CPU_DECODED,
    VllmAmxLayout,
    VllmCpuLayout,
    VllmFlashLayout,
    VllmTileLayout,
    cpu_page_decoder,
    vllm_layout_for,
)
from engine.kv_cache import PagedKVLayout
from tests.fixtures.vllm import needs_fp8_kv

# (isa, dtype, block_size, head_size): each kernel family kvtier decodes, in the dtypes vLLM's
# CPU backend gives it ("vec16": block size below 32 or head size not a multiple of 32; "amx":
# bfloat16, block size a multiple of 32).
CASES = [("vec", torch.float32, 128, 64), ("vec16", torch.float32, 16, 64), ("vec", torch.bfloat16, 32, 128),
         ("vec16", torch.float16, 128, 80), ("amx", torch.bfloat16, 32, 128), ("amx", torch.bfloat16, 64, 64)]
NUM_BLOCKS, KV_HEADS, Q_HEADS, LAYERS = 5, 3, 6, 2
TABLE = [4, 1, 3]  # out of order, as vLLM hands out blocks


def writes_pages(isa: str) -> None:
    """Skips the test where vLLM's CPU build has no `isa` cache-writing op: its "amx" kernels
    are compiled only into the library it loads on CPUs with AVX512-BF16 (vllm/_C; vllm/_C_AVX512
    and vllm/_C_AVX2 have none)."""
    if isa == "amx" and not torch.cpu._is_avx512_bf16_supported():
        missing = "avx512_bf16" if torch.cpu._is_avx512_supported() else "avx512f and avx512_bf16"
        pytest.skip(f"vLLM's CPU build has its amx kernels only on CPUs with AVX512-BF16; this one lacks {missing}")


def runs_attention(isa: str) -> None:
    """Skips the test where this CPU cannot run vLLM's `isa` attention kernels."""
    writes_pages(isa)
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("vLLM's amx attention kernels need a CPU with AMX tiles (amx_tile), which this one lacks")


def decoded_layout(caches: list[torch.Tensor], isa: str) -> PagedKVLayout:
    """The layout the connector reads pages written by `isa` with."""
    decoder = cpu_page_decoder(isa, caches[0].element_size())
    assert decoder == isa
    return vllm_layout_for(caches, "cpu", decoder=decoder)


def halves(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache) as vLLM's CPU backend passes them to its kernels."""
    nb, h, bs, _ = cache.shape
    k, v = cache.view(nb, h, 2 * bs, -1).chunk(2, dim=2)
    return k, v


def prompt(dtype: torch.dtype, block_size: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, kv): two full blocks and a partial one of TABLE, and random K/V
    `(LAYERS, 2, n, KV_HEADS, head_size)` for them."""
    n = 2 * block_size + 5
    slots = torch.tensor([TABLE[t // block_size] * block_size + t % block_size for t in range(n)])
    return slots, torch.randn(LAYERS, 2, n, KV_HEADS, head_size).to(dtype)


def empty_caches(dtype: torch.dtype, block_size: int, head_size: int) -> list[torch.Tensor]:
    """Per layer `(NUM_BLOCKS, KV_HEADS, block_size, 2 * head_size)` views of one zeroed buffer."""
    return list(torch.zeros(LAYERS, NUM_BLOCKS, KV_HEADS, block_size, 2 * head_size, dtype=dtype).unbind(0))


@pytest.mark.parametrize(("isa", "dtype", "block_size", "head_size"), CASES)
def test_layout_reads_and_writes_the_kernels_bytes(isa: str, dtype: torch.dtype, block_size: int,
                                                   head_size: int) -> None:
    writes_pages(isa)
    torch.manual_seed(0)
    slots, kv = prompt(dtype, block_size, head_size)
    caches = empty_caches(dtype, block_size, head_size)
    write_with_kernel(caches, kv, slots, isa)
    layout = decoded_layout(caches, isa)
    assert torch.equal(layout.gather_chunk(slots), kv)
    assert torch.equal(torch.cat(layout.gather_layers(slots[3:9])), kv[:, :, 3:9])
    assert_scatter_writes_the_kernels_bytes(layout, slots, kv)


def write_with_kernel(caches: list[torch.Tensor], kv: torch.Tensor, slots: torch.Tensor, isa: str,
                      kv_cache_dtype: str = "auto", steps: tuple[int, ...] = ()) -> None:
    """Writes `kv` into `caches` at `slots` with vLLM's own `cpu_attn_reshape_and_cache`, in one
    call per layer, or one per range between the token positions `steps`."""
    bounds = steps or (0, len(slots))
    for layer, cache in enumerate(caches):
        for lo, hi in zip(bounds, bounds[1:]):
            ops.cpu_attn_reshape_and_cache(kv[layer, 0, lo:hi], kv[layer, 1, lo:hi], *halves(cache), slots[lo:hi],
                                           isa, 1.0, 1.0, kv_cache_dtype)


def assert_scatter_writes_the_kernels_bytes(layout: PagedKVLayout, slots: torch.Tensor, chunk: torch.Tensor) -> None:
    """Scattered into zeroed caches, `chunk` gives the bytes the kernel wrote, everywhere."""
    written = [c.clone() for c in layout.kv_caches]
    for c in layout.kv_caches:
        c.zero_()
    layout.scatter_chunk(slots, chunk)
    assert all(torch.equal(a, b) for a, b in zip(layout.kv_caches, written))


# vLLM's fp8 K/V formats on CPU, as torch decodes them ("fp8" is e4m3), with one step of each
# format's mantissa as the relative bound: vLLM's kernel rounds some values one step from torch's.
FP8 = {"fp8": (torch.float8_e4m3fn, 2**-3), "fp8_e4m3": (torch.float8_e4m3fn, 2**-3),
       "fp8_e5m2": (torch.float8_e5m2, 2**-2)}


@needs_fp8_kv()
@pytest.mark.parametrize("kv_cache_dtype", sorted(FP8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_pages_hold_one_byte_where_the_model_dtype_would(kv_cache_dtype: str, dtype: torch.dtype) -> None:
    """vLLM's CPU kernels write fp8 K/V into "vec" pages, one byte per value where the model
    dtype's element would sit: the layout's gather decodes to the K/V within a step of the
    format, token ranges and the compiled copy agree, and a scatter writes the kernel's bytes."""
    torch.manual_seed(0)
    block_size, head_size, isa = 32, 64, "vec"  # "amx" writes fp8 otherwise: moved as tiles (below)
    slots, kv = prompt(dtype, block_size, head_size)
    caches = empty_caches(torch.uint8, block_size, head_size)
    write_with_kernel(caches, kv, slots, isa, kv_cache_dtype)
    layout = VllmCpuLayout(caches)
    chunk = layout.gather_chunk(slots)
    assert chunk.dtype == torch.uint8 and torch.equal(chunk, VllmCpuLayout(caches, kernels=False).gather_chunk(slots))
    fp8, step = FP8[kv_cache_dtype]
    torch.testing.assert_close(chunk.view(fp8).float(), kv.float(), rtol=step, atol=2**-6)
    assert torch.equal(torch.cat(layout.gather_layers(slots[3:9])), chunk[:, :, 3:9])
    assert_scatter_writes_the_kernels_bytes(layout, slots, chunk)
    if kv_cache_dtype == "fp8":  # keyed as e4m3: the same bytes as vLLM's "fp8_e4m3"
        e4m3 = empty_caches(torch.uint8, block_size, head_size)
        write_with_kernel(e4m3, kv, slots, isa, "fp8_e4m3")
        assert all(torch.equal(a, b) for a, b in zip(caches, e4m3))


def kernel_attention(cache: torch.Tensor, q: torch.Tensor, seq_len: int, isa: str) -> torch.Tensor:
    """vLLM's CPU attention of queries `q` `(Tq, Q_HEADS, D)`, the last Tq positions of one
    causal sequence of `seq_len` tokens whose K/V sit in `cache` under block table TABLE."""
    dtype, head_size = cache.dtype, q.shape[2]
    query_start = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=head_size, seq_lens=seq_lens, dtype=dtype,
        query_start_loc=query_start, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)
    out = torch.empty_like(q)
    key_cache, value_cache = halves(cache)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=query_start,
        seq_lens=seq_lens, scale=1 / math.sqrt(head_size), causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=torch.tensor([TABLE], dtype=torch.int32), softcap=0.0, scheduler_metadata=meta, s_aux=None)
    return out


def reference_attention(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query attention in fp32 of `q`, the last positions, over K/V `(n, KV_HEADS, D)`."""
    n, tq, group = k.shape[0], q.shape[0], Q_HEADS // KV_HEADS
    kf, vf = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) / math.sqrt(q.shape[2])
    future = torch.arange(n).view(1, -1) > torch.arange(n - tq, n).view(-1, 1)
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(future, float("-inf")).softmax(-1), vf)


@pytest.mark.parametrize(("isa", "dtype", "block_size", "head_size"), CASES)
def test_vllm_attention_reads_what_the_layout_scatters(isa: str, dtype: torch.dtype, block_size: int,
                                                       head_size: int) -> None:
    runs_attention(isa)
    torch.manual_seed(1)
    slots, kv = prompt(dtype, block_size, head_size)
    q = torch.randn(4, Q_HEADS, head_size).to(dtype)
    expected = reference_attention(kv[1, 0], kv[1, 1], q)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # the kernel's output is rounded to `dtype`
    caches = empty_caches(dtype, block_size, head_size)
    decoded_layout(caches, isa).scatter_chunk(slots, kv)
    got = kernel_attention(caches[1], q, len(slots), isa).float()
    assert (got - expected).abs().max().item() <= tol
    # The check tells layouts apart: the same K/V laid out as token rows `[K | V]` is misread.
    VllmFlashLayout(caches).scatter_chunk(slots, kv)
    misread = kernel_attention(caches[1], q, len(slots), isa).float()
    assert (misread - expected).abs().max().item() > 10 * tol


def test_the_kernels_vllm_picks_here_get_their_layout() -> None:
    """Whatever this CPU is, caches of each case's shape, written by the kernels vLLM picks
    for it here, get the layout that decodes them (or moves them as tiles): none is refused."""
    for _, dtype, block_size, head_size in CASES:
        isa = _get_attn_isa(dtype, block_size, head_size)
        caches = empty_caches(dtype, block_size, head_size)
        layout = vllm_layout_for(caches, "cpu", decoder=cpu_page_decoder(isa, caches[0].element_size()))
        assert type(layout) is CPU_DECODED.get(isa, VllmTileLayout), (isa, dtype, block_size, head_size)
    if torch.cpu._is_amx_tile_supported():  # the case this is for: bfloat16 on a Xeon with AMX tiles
        assert type(decoded_layout(empty_caches(torch.bfloat16, 128, 64), "amx")) is VllmAmxLayout
        assert _get_attn_isa(torch.bfloat16, 128, 64) == "amx"


# (isa, dtype, kv_cache_dtype): "amx" writes fp8 K/V in a format of its own, moved only as tiles.
TILE_CASES = [("vec", torch.bfloat16, "auto"), ("vec16", torch.float32, "auto"), ("amx", torch.bfloat16, "auto"),
              ("amx", torch.bfloat16, "fp8_e4m3")]


@pytest.mark.parametrize(("isa", "dtype", "kv_cache_dtype"), TILE_CASES)
def test_a_tiles_bytes_depend_only_on_its_tokens(isa: str, dtype: torch.dtype, kv_cache_dtype: str) -> None:
    """The same tokens written into another block, into a cache of fewer KV heads (a
    tensor-parallel rank's), or in two steps give the same tile bytes; tiles gathered from one
    cache and scattered into fresh blocks of another are the bytes the kernel writes there."""
    writes_pages(isa)
    if kv_cache_dtype != "auto" and not torch.cpu._is_avx512_supported():
        pytest.skip("vLLM's CPU build writes fp8 K/V only on a CPU with AVX-512 or AMX, which this one lacks")
    torch.manual_seed(2)
    block_size = 16 if isa == "vec16" else 32
    head_size, elem = 64, torch.uint8 if kv_cache_dtype != "auto" else dtype
    slots, kv = prompt(dtype, block_size, head_size)
    whole = slots[:2 * block_size]  # the first two blocks of TABLE
    a = empty_caches(elem, block_size, head_size)
    write_with_kernel(a, kv, slots, isa, kv_cache_dtype)
    b = empty_caches(elem, block_size, head_size)  # the same tokens in blocks 2 and 0, in two steps
    moved = torch.tensor([blk * block_size + t % block_size for blk in (2, 0) for t in range(block_size)])
    write_with_kernel(b, kv[:, :, :2 * block_size], moved, isa, kv_cache_dtype, steps=(0, 7, 2 * block_size))
    fewer = [c[:, 1:] for c in empty_caches(elem, block_size, head_size)]  # KV heads 1 and 2 only
    write_with_kernel(fewer, kv[:, :, :2 * block_size, 1:], whole, isa, kv_cache_dtype)
    for layer in range(LAYERS):
        assert torch.equal(b[layer][2], a[layer][TABLE[0]]) and torch.equal(b[layer][0], a[layer][TABLE[1]])
        assert torch.equal(fewer[layer][TABLE[0]], a[layer][TABLE[0], 1:])
    tiles = VllmTileLayout(a).gather_chunk(whole)
    fresh = empty_caches(elem, block_size, head_size)
    VllmTileLayout(fresh).scatter_chunk(moved, tiles)
    assert all(torch.equal(x, y) for x, y in zip(fresh, b))
    rank = VllmTileLayout(fewer).gather_chunk(whole)  # a rank's heads are the whole chunk's
    assert torch.equal(rank, tiles[:, :, :, 1:])
