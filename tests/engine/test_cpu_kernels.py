"""The engine's CPU fast paths against its PyTorch reference path: the compiled paged decode
attention (engine/cpu_ops.py) against the gather + SDPA path, and whole generations with
`kernels="auto"` against `kernels="torch"`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.attention_metadata import AttentionMetadata
from engine.kv_cache import slot_mapping
from engine.layers import mlp as mlp_module
from engine.linear_backend import PanelLinear
from engine.model_loader import load_model
from engine.paged_attention import build_plan, paged_attention
from harness import process

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]


def _decode_case(lens: list[int], dtype: torch.dtype, seed: int, bs: int = 16, hq: int = 9, hkv: int = 3,
                 d: int = 64, q_lens: list[int] | None = None) -> tuple[torch.Tensor, ...]:
    """A step of len(lens) sequences over shuffled blocks of a random cache: decodes, or the
    last `q_lens` tokens of each (their K/V, returned too, already in the cache)."""
    q_lens = q_lens or [1] * len(lens)
    g = torch.Generator().manual_seed(seed)
    blocks_each = [-(-n // bs) for n in lens]
    num_blocks = sum(blocks_each) + 5
    kv = torch.randn(2, num_blocks, bs, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(blocks_each) + 2, dtype=torch.long)
    used = 0
    for i, nb in enumerate(blocks_each):
        tables[i, :nb] = perm[used:used + nb]
        used += nb
    seq_index = torch.tensor([i for i, n in enumerate(q_lens) for _ in range(n)])
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(lens, q_lens)])
    slots = slot_mapping(tables, seq_index, positions, bs)
    qsl = [sum(q_lens[:i]) for i in range(len(lens) + 1)]
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, query_start_loc=qsl, seq_lens=lens, block_size=bs)
    q = torch.randn(qsl[-1], hq, d, generator=g).to(dtype)
    k, v = kv.flatten(1, 2)[:, slots]  # the new tokens' K/V, as written to the cache
    return q, k, v, kv, meta  # type: ignore[return-value]


# Lengths cross the kernel's partition (512 keys) and block boundaries; 1 is a lone key.
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_kernel_equals_gather_path(ops, window: int | None, dtype: torch.dtype, tol: float) -> None:
    q, k, v, kv, meta = _decode_case([1, 17, 300, 513, 1500], dtype, seed=1)
    ref = paged_attention(q, k, v, kv, build_plan(meta, CPU, dtype, window), 0.125)
    plan = build_plan(meta, CPU, dtype, window, ops)
    assert plan.decode_ops is ops and plan.decode_slots is None  # the kernel path is the one tested
    got = paged_attention(q, k, v, kv, plan, 0.125)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=0)


# Query heads per kv head 1, 5 and 8 split into the kernel's groups differently (3 + 2 for K
# and 4 + 1 for V at G = 5; 2 per group for V at head size 128); lengths off the 8-key steps.
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (10, 2, 64), (8, 1, 128), (6, 3, 32)])
def test_decode_kernel_head_groupings(ops, hq: int, hkv: int, d: int) -> None:
    q, k, v, kv, meta = _decode_case([1, 9, 300, 700], torch.float32, seed=4, hq=hq, hkv=hkv, d=d)
    ref = paged_attention(q, k, v, kv, build_plan(meta, CPU), 0.125)
    got = paged_attention(q, k, v, kv, build_plan(meta, CPU, cpu_ops=ops), 0.125)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


# Prefills over cached context, short and long, inside and beyond the window, among decodes:
# the tiled prefill kernel answers those of 8+ new tokens the window does not bite, the decode
# kernel's rows the others (one row per new token).
@pytest.mark.parametrize("window", [None, 100])
def test_kernels_answer_prefills_over_cached_context(ops, window: int | None) -> None:
    lens, q_lens = [40, 301, 90, 1400, 700], [30, 1, 85, 1100, 3]
    q, k, v, kv, meta = _decode_case(lens, torch.float32, seed=5, q_lens=q_lens)
    ref = paged_attention(q, k, v, kv, build_plan(meta, CPU, sliding_window=window), 0.125)
    plan = build_plan(meta, CPU, sliding_window=window, cpu_ops=ops)
    assert not plan.prefills and plan.tiled_lens is not None
    tiled = [30, 85] if window else [30, 85, 1100]  # 3 new tokens: the decode kernel's rows
    assert plan.tiled_lens.tolist() == tiled and plan.decode_batch == sum(q_lens) - sum(tiled)
    got = paged_attention(q, k, v, kv, plan, 0.125)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


# Fresh prompts (2 to 300 tokens: one tile, several, a partial last one) and prefills over
# cached context beside a decode; head groupings and head sizes the kernel tiles differently
# (24 and 48: not a multiple of its 4 x 16 columns), with and without a soft cap that bites.
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 1, 128), (6, 3, 24), (4, 4, 48), (16, 2, 32)])
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_prefill_kernel_equals_gather_path(ops, hq: int, hkv: int, d: int, softcap: float | None) -> None:
    lens, q_lens = [2, 33, 300, 77, 520, 9], [2, 33, 300, 40, 130, 1]
    q, k, v, kv, meta = _decode_case(lens, torch.float32, seed=6, hq=hq, hkv=hkv, d=d, q_lens=q_lens)
    ref = paged_attention(q, k, v, kv, build_plan(meta, CPU), 0.3, softcap)
    plan = build_plan(meta, CPU, cpu_ops=ops)
    assert plan.tiled_lens is not None and plan.tiled_lens.tolist() == q_lens[:-1] and plan.decode_batch == 1
    got = paged_attention(q, k, v, kv, plan, 0.3, softcap)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_prefill_kernel_beside_a_one_token_prompt(ops) -> None:
    """A one-token prompt stays on the SDPA path while the others take the kernel: the step is
    not the single fresh prompt whose output SDPA writes whole."""
    q, k, v, kv, meta = _decode_case([1, 5, 37], torch.float32, seed=8, q_lens=[1, 5, 37])
    ref = paged_attention(q, k, v, kv, build_plan(meta, CPU), 0.125)
    plan = build_plan(meta, CPU, cpu_ops=ops)
    assert len(plan.prefills) == 1 and plan.tiled_lens is not None and plan.tiled_lens.tolist() == [5, 37]
    torch.testing.assert_close(paged_attention(q, k, v, kv, plan, 0.125), ref, atol=1e-5, rtol=1e-5)


def test_prefill_kernel_refuses_bad_inputs(ops) -> None:
    q, _, _, kv, meta = _decode_case([40], torch.float32, seed=7, q_lens=[40])
    out = torch.empty_like(q)
    one, forty = torch.tensor([0]), torch.tensor([40])
    with pytest.raises(RuntimeError, match="outside q"):
        ops.paged_prefill_attention(q, kv, meta.block_tables, one, torch.tensor([41]), one * 0, 0.1, 0.0, out)
    with pytest.raises(RuntimeError, match="more keys than its block table"):
        ops.paged_prefill_attention(q, kv, meta.block_tables[:, :2], one, forty, one * 0, 0.1, 0.0, out)
    with pytest.raises(RuntimeError, match="contiguous int64 with one row per prefill"):
        ops.paged_prefill_attention(q, kv, meta.block_tables, one, forty.int(), one * 0, 0.1, 0.0, out)
    with pytest.raises(RuntimeError, match="kv_cache must be contiguous float32"):
        ops.paged_prefill_attention(q, kv.bfloat16(), meta.block_tables, one, forty, one * 0, 0.1, 0.0, out)


def test_decode_kernel_in_a_mixed_step(ops) -> None:
    """Decode rows interleaved with a prefill chunk over cached context: the kernel answers
    both, as the gather path does."""
    bs = 16
    lens = [40, 70, 33]  # query lengths 1, 30, 1: the middle one is a prefill chunk over cached context
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 20, bs, 2, 32, generator=g)
    tables = torch.arange(18).view(3, 6)
    qsl = [0, 1, 31, 32]
    meta = AttentionMetadata(slot_mapping=torch.zeros(32, dtype=torch.long), block_tables=tables,
                             query_start_loc=qsl, seq_lens=lens, block_size=bs)
    q = torch.randn(32, 4, 32, generator=g)
    k, v = torch.randn(32, 2, 32, generator=g), torch.randn(32, 2, 32, generator=g)
    ref = paged_attention(q, k, v, kv, build_plan(meta, CPU), 0.2)
    got = paged_attention(q, k, v, kv, build_plan(meta, CPU, cpu_ops=ops), 0.2)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_decode_kernel_leaves_the_cache_alone(ops) -> None:
    q, k, v, kv, meta = _decode_case([200, 64], torch.float32, seed=2)
    before = kv.clone()
    paged_attention(q, k, v, kv, build_plan(meta, CPU, cpu_ops=ops), 0.125)
    assert torch.equal(kv, before)


def test_decode_kernel_refuses_bad_inputs(ops) -> None:
    q, _, _, kv, meta = _decode_case([20], torch.float32, seed=4)
    lens = torch.tensor([20])
    with pytest.raises(RuntimeError, match="block_tables, starts and lens"):
        ops.paged_decode_attention(q, kv, meta.block_tables.int(), torch.tensor([0]), lens, 0.1, 512)
    with pytest.raises(RuntimeError, match="heads disagree"):
        ops.paged_decode_attention(q[:, :, :32].contiguous(), kv, meta.block_tables, torch.tensor([0]), lens, 0.1, 512)


def test_mlp_in_passes_equals_pytorch(ops) -> None:
    """A long prefill's MLP runs in passes of rows on the fused path; the rows come out as
    PyTorch's unfused MLP computes them, the last (partial) pass included."""
    torch.manual_seed(0)
    mlp = mlp_module.GatedMLP(32, 48)
    x = torch.randn(2 * mlp_module._ROWS_PER_PASS + 5, 32)
    ref = mlp(x)  # no cpu_ops: split, F.silu, multiply
    mlp.cpu_ops = ops
    torch.testing.assert_close(mlp(x), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_fused_ops_equal_pytorch(ops, rows: int) -> None:
    """The fused norm (with and without the residual add), MLP activation and RoPE against the
    PyTorch ops they replace."""
    from engine.models.llama import RMSNorm

    g = torch.Generator().manual_seed(rows)
    x, res = torch.randn(rows, 96, generator=g) * 3, torch.randn(rows, 96, generator=g)
    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.normal_(generator=g)
    ref_norm = norm(x)
    ref_added, ref_res = norm.add_forward(x, res)
    norm.cpu_ops = ops
    torch.testing.assert_close(norm(x), ref_norm, atol=1e-5, rtol=1e-5)
    stream = res.clone()
    got_added, got_res = norm.add_forward(x, stream)
    assert got_res is stream  # added in place
    torch.testing.assert_close(got_res, ref_res, atol=0, rtol=0)
    torch.testing.assert_close(got_added, ref_added, atol=1e-5, rtol=1e-5)
    # silu(gate) * up over a wide range, including large negative and positive gates
    gate_up = torch.cat([torch.linspace(-100, 100, rows * 64).view(rows, 64), torch.randn(rows, 64, generator=g)], 1)
    gate, up = gate_up.split(64, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    # RoPE on the first 3 heads of [q | k | v]-like rows, in place, against apply_rotary
    from engine.rotary import apply_rotary, build_cos_sin_cache, compute_inv_freq

    table = build_cos_sin_cache(compute_inv_freq(32, 10000.0), 4096, torch.float32, "cpu")
    flat = torch.randn(rows, 4 * 32, generator=g)
    positions = torch.randint(0, 4096, (rows,), generator=g)
    ref = apply_rotary(flat.view(rows, 4, 32)[:, :3], positions, table)
    untouched = flat[:, 96:].clone()
    ops.rotary_(flat, positions, table, 3)
    torch.testing.assert_close(flat.view(rows, 4, 32)[:, :3], ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(flat[:, 96:], untouched)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        ops.rotary_(flat, torch.full((rows,), 4096), table, 3)
    with pytest.raises(RuntimeError, match="even number of columns"):
        ops.silu_and_mul(torch.zeros(2, 3))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.rms_norm(x.double(), norm.weight, 1e-5)


def test_unknown_kernels_is_refused_before_loading(default_model_path) -> None:
    with pytest.raises(ValueError, match="kernels must be one of"):
        load_model(default_model_path, CPU, torch.float32, kernels="fast")
    with pytest.raises(ValueError, match="kernels must be one of"):
        LLM(kernels="fast")


@pytest.mark.slow
def test_generations_identical_with_and_without_fast_paths(ops) -> None:
    """Greedy tokens of a batch (short and >512-token contexts, so the kernel partitions) are
    the same on the fast paths and on PyTorch's ops."""
    base = "The paged KV cache stores keys and values in fixed-size blocks. "
    prompts = [base * 2, "Hello, my name is", base * 60, "Write a haiku about caches."]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for kernels in ("auto", "torch"):
        with LLM(kernels=kernels, kv_cache_memory_bytes=256 << 20) as llm:
            model = llm.engine.runner.model
            assert (model.cpu_ops is not None) == (kernels == "auto")
            assert isinstance(model.lm_head, PanelLinear) == (kernels == "auto")
            results = llm.generate(prompts, params)
            outs[kernels] = [o.outputs[0].token_ids for o in results]
    assert len(results[2].prompt_token_ids) > 512  # its decode spans two kernel partitions
    assert outs["auto"] == outs["torch"]


def test_a_build_killed_mid_way_leaves_no_load_waiting(ops) -> None:
    """torch's baton file, as a build killed mid-way leaves it in the build dir, is cleared by
    the next load, which returns the kernels (torch alone waits for it forever)."""
    baton = Path(ops.__file__).parent / "lock"
    baton.touch()
    try:
        done = process.run([sys.executable, "-c", "from engine import cpu_ops; assert cpu_ops.load()"],
                           cwd=REPO, timeout=120)
    finally:
        stale = baton.exists()
        baton.unlink(missing_ok=True)
    assert done.returncode == 0 and not stale
