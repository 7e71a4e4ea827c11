"""VllmCpuLayout against vLLM's own CPU attention kernels: it reads exactly what
`cpu_attn_reshape_and_cache` writes, it scatters the bytes that kernel would have written,
and vLLM's attention (`cpu_attention_with_kv_cache`) over K/V it scattered equals attention
computed from those K/V directly. Runs in vLLM's virtualenv only (`make test-vllm`)."""

from __future__ import annotations

import math

import pytest
import torch
import vllm
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from connector.vllm_layouts import VllmCpuLayout, VllmFlashLayout
from tests.fixtures.vllm import needs_fp8_kv

# (dtype, block_size, head_size): both ISAs this layout covers, "vec" and "vec16" (block
# size below 32 or head size not a multiple of 32), in every dtype vLLM's CPU backend takes.
CASES = [(torch.float32, 128, 64), (torch.float32, 16, 64), (torch.bfloat16, 32, 128), (torch.float16, 128, 80)]
NUM_BLOCKS, KV_HEADS, Q_HEADS, LAYERS = 5, 3, 6, 2
TABLE = [4, 1, 3]  # out of order, as vLLM hands out blocks


def kernel_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    isa = _get_attn_isa(dtype, block_size, head_size)
    assert isa in ("vec", "vec16"), f"vLLM {vllm.__version__} picked ISA {isa!r}; VllmCpuLayout knows vec and vec16"
    return isa


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


@pytest.mark.parametrize(("dtype", "block_size", "head_size"), CASES)
def test_layout_reads_and_writes_the_kernels_bytes(dtype: torch.dtype, block_size: int, head_size: int) -> None:
    torch.manual_seed(0)
    isa = kernel_isa(dtype, block_size, head_size)
    slots, kv = prompt(dtype, block_size, head_size)
    caches = empty_caches(dtype, block_size, head_size)
    write_with_kernel(caches, kv, slots, isa)
    layout = VllmCpuLayout(caches)
    assert torch.equal(layout.gather_chunk(slots), kv)
    assert torch.equal(torch.cat(layout.gather_layers(slots[3:9])), kv[:, :, 3:9])
    assert_scatter_writes_the_kernels_bytes(layout, slots, kv)


def write_with_kernel(caches: list[torch.Tensor], kv: torch.Tensor, slots: torch.Tensor, isa: str,
                      kv_cache_dtype: str = "auto") -> None:
    """Writes `kv` into `caches` at `slots` with vLLM's own `cpu_attn_reshape_and_cache`."""
    for layer, cache in enumerate(caches):
        ops.cpu_attn_reshape_and_cache(kv[layer, 0], kv[layer, 1], *halves(cache), slots, isa, 1.0, 1.0,
                                       kv_cache_dtype)


def assert_scatter_writes_the_kernels_bytes(layout: VllmCpuLayout, slots: torch.Tensor, chunk: torch.Tensor) -> None:
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
    block_size, head_size = 32, 64
    isa = _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)
    assert isa in ("vec", "vec16"), isa
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


@pytest.mark.parametrize(("dtype", "block_size", "head_size"), CASES)
def test_vllm_attention_reads_what_the_layout_scatters(dtype: torch.dtype, block_size: int, head_size: int) -> None:
    torch.manual_seed(1)
    isa = kernel_isa(dtype, block_size, head_size)
    slots, kv = prompt(dtype, block_size, head_size)
    q = torch.randn(4, Q_HEADS, head_size).to(dtype)
    expected = reference_attention(kv[1, 0], kv[1, 1], q)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # the kernel's output is rounded to `dtype`
    caches = empty_caches(dtype, block_size, head_size)
    VllmCpuLayout(caches).scatter_chunk(slots, kv)
    got = kernel_attention(caches[1], q, len(slots), isa).float()
    assert (got - expected).abs().max().item() <= tol
    # The check tells layouts apart: the same K/V laid out as token rows `[K | V]` is misread.
    VllmFlashLayout(caches).scatter_chunk(slots, kv)
    misread = kernel_attention(caches[1], q, len(slots), isa).float()
    assert (misread - expected).abs().max().item() > 10 * tol
