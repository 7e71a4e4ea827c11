"""Attention features Gemma needs, against a plain dense reference on random tensors: a softmax
scale other than head_size ** -0.5, soft-capped scores (`cap * tanh(s / cap)` before the mask
and softmax), and sliding windows, on every path of engine/paged_attention.py (fresh prefill,
prefill over cached context padded and masked, window tiles, decode gathered and in the
compiled CPU kernel), with sequences spread over many shuffled blocks of a NaN-filled cache."""

from __future__ import annotations

import pytest
import torch

from engine.attention_metadata import AttentionMetadata
from engine.paged_attention import build_plan, paged_attention

CPU = torch.device("cpu")
HQ, HKV, D, BS = 4, 2, 32, 16
SCALE = 0.3  # not D ** -0.5 (0.177): a query_pre_attn_scalar of ~11
CAP = 2.0  # small against scores of std ~4, so the cap bites hard

# (seq_len, query_len) per sequence of one step, covering every path: fresh prefills (7 tokens,
# two 256-query tiles), prefills over cached context (masked: 30 new after 300; padded: 1100 new
# after 400, several tiles), decodes over 1, 2 and many blocks and across the kernel's 512-key
# partition.
MIXED = [(7, 7), (300, 300), (330, 30), (1500, 1100), (17, 1), (40, 1), (1500, 1)]


def _step(specs: list[tuple[int, int]], seed: int, dtype: torch.dtype = torch.float32):
    """Random q/k/v of whole sequences and one step's paged view of them: each sequence's keys
    and values at every position written into shuffled blocks of a NaN-filled cache (a read of
    any other slot poisons the output), the last query_len positions as the step's new rows.
    Returns (q, k, v, kv_cache, meta, per-sequence (Q, K, V) in float64)."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = [-(-n // BS) for n, _ in specs]
    kv_cache = torch.full((2, sum(n_blocks) + 3, BS, HKV, D), float("nan"), dtype=dtype)
    perm = torch.randperm(kv_cache.shape[1], generator=g)
    tables = torch.zeros(len(specs), max(n_blocks) + 1, dtype=torch.long)
    qs, ks, vs, slots, full = [], [], [], [], []
    used = 0
    for i, ((n, q_len), nb) in enumerate(zip(specs, n_blocks)):
        tables[i, :nb] = perm[used:used + nb]
        used += nb
        seq = [(torch.randn(n, h, D, generator=g) * 1.5).to(dtype) for h in (HQ, HKV, HKV)]
        pos = torch.arange(n)
        flat = tables[i, pos // BS] * BS + pos % BS
        kv_cache.view(2, -1, HKV, D)[0, flat] = seq[1]
        kv_cache.view(2, -1, HKV, D)[1, flat] = seq[2]
        qs.append(seq[0][n - q_len:])
        ks.append(seq[1][n - q_len:])
        vs.append(seq[2][n - q_len:])
        slots.append(flat[n - q_len:])
        full.append(tuple(t.double() for t in seq))
    qsl = [0]
    for _, q_len in specs:
        qsl.append(qsl[-1] + q_len)
    meta = AttentionMetadata(slot_mapping=torch.cat(slots), block_tables=tables, query_start_loc=qsl,
                             seq_lens=[n for n, _ in specs], block_size=BS)
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), kv_cache, meta, full


def _reference(full, specs: list[tuple[int, int]], cap: float | None,
               window: int | None) -> torch.Tensor:
    """Dense float64 attention of each sequence's last query_len positions: scores
    `SCALE * q.k`, capped, then causal (and window: i - W < j <= i) masked, softmax, times v."""
    outs = []
    for (q, k, v), (n, q_len) in zip(full, specs):
        k, v = (t.repeat_interleave(HQ // HKV, dim=1) for t in (k, v))
        s = torch.einsum("qhd,khd->hqk", q[n - q_len:], k) * SCALE
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        qp, kp = torch.arange(n - q_len, n).unsqueeze(1), torch.arange(n).unsqueeze(0)
        blocked = kp > qp
        if window is not None:
            blocked |= kp <= qp - window
        outs.append(torch.einsum("hqk,khd->qhd", s.masked_fill(blocked, float("-inf")).softmax(-1), v))
    return torch.cat(outs)


@pytest.fixture(scope="module")
def mixed():
    """The MIXED step, and its dense references by (cap, window), made once for the module."""
    step = _step(MIXED, seed=1)
    refs = {(c, w): _reference(step[-1], MIXED, c, w) for c in (None, CAP) for w in (None, 40)}
    return step, refs


@pytest.mark.parametrize("kernel", [False, True], ids=["gather", "kernel"])
@pytest.mark.parametrize("window", [None, 40], ids=["global", "window40"])
@pytest.mark.parametrize("cap", [None, CAP], ids=["nocap", "cap"])
def test_mixed_step_matches_dense_reference(ops, mixed, cap: float | None, window: int | None,
                                            kernel: bool) -> None:
    (q, k, v, kv_cache, meta, _), refs = mixed
    plan = build_plan(meta, CPU, torch.float32, window, ops if kernel else None)
    assert (plan.decode_ops is not None) == kernel  # the decode path under test is the one taken
    got = paged_attention(q, k, v, kv_cache, plan, SCALE, cap)
    torch.testing.assert_close(got.double(), refs[cap, window], atol=2e-5, rtol=0)
    # Not vacuous: the cap, the scale and the window each change the result far beyond that.
    assert (refs[None if cap else CAP, window] - refs[cap, window]).abs().max() > 0.1
    assert (refs[cap, None if window else 40] - refs[cap, window]).abs().max() > 0.1
    other_scale = paged_attention(q, k, v, kv_cache, plan, D ** -0.5, cap)
    assert (other_scale.double() - refs[cap, window]).abs().max() > 0.1


@pytest.mark.parametrize("window", [None, 40], ids=["global", "window40"])
@pytest.mark.parametrize("n", [7, 300, 1500])
def test_single_fresh_prefill_matches_dense_reference(n: int, window: int | None) -> None:
    """One prompt alone in its step: the path without an output copy."""
    specs = [(n, n)]
    q, k, v, kv_cache, meta, full = _step(specs, seed=n)
    got = paged_attention(q, k, v, kv_cache, build_plan(meta, CPU, torch.float32, window), SCALE, CAP)
    torch.testing.assert_close(got.double(), _reference(full, specs, CAP, window), atol=2e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 100], ids=["global", "window100"])
def test_capped_decode_kernel_equals_gather_path_bf16(ops, window: int | None) -> None:
    specs = [(1, 1), (17, 1), (300, 1), (513, 1), (1500, 1)]
    q, k, v, kv_cache, meta, _ = _step(specs, seed=2, dtype=torch.bfloat16)
    ref = paged_attention(q, k, v, kv_cache, build_plan(meta, CPU, torch.bfloat16, window), SCALE, CAP)
    got = paged_attention(q, k, v, kv_cache, build_plan(meta, CPU, torch.bfloat16, window, ops), SCALE, CAP)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=0)


def test_kernel_cap_is_tanh_over_the_whole_range(ops) -> None:
    """Scores from -400 to 400 against a cap of 50 (Gemma 2's), past the kernel's tanh clamp:
    one key per score, so each output is the capped softmax weight of a known value."""
    n = 801
    kv = torch.zeros(2, 1, n, 1, 16)
    kv[0, 0, :, 0, 0] = torch.linspace(-400, 400, n)  # key t scores linspace[t] against q = e0
    kv[1, 0, :, 0, :] = torch.randn(n, 16, generator=torch.Generator().manual_seed(3))
    q = torch.zeros(1, 1, 16)
    q[0, 0, 0] = 1.0
    got = ops.paged_decode_attention(q, kv, torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]),
                                     torch.tensor([n]), 1.0, 128, softcap=50.0)
    s = 50.0 * torch.tanh(kv[0, 0, :, 0, 0].double() / 50.0)
    ref = s.softmax(0) @ kv[1, 0, :, 0, :].double()
    torch.testing.assert_close(got[0, 0].double(), ref, atol=1e-5, rtol=0)
