"""Scheduler: chunked prefill, token budget, max_num_seqs, preemption by recompute, stops.

The model is replaced by a deterministic next-token rule (tests/fixtures/scheduler.py) so
that only scheduling is under test here; the real model runs through the scheduler in
test_llm / test_prefix_caching.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sequence import SequenceStatus
from tests.fixtures.scheduler import expected_output, make, next_token, run, seq


def test_chunked_prefill_splits_long_prompt_under_budget() -> None:
    s = make(budget=32)
    a = seq("a", list(range(3, 103)), max_tokens=3)
    s.add(a)
    plans = run(s)
    assert [p[0][1:] for p in plans] == [(0, 32), (32, 32), (64, 32), (96, 4), (100, 1), (101, 1)]
    assert a.output_token_ids == expected_output(list(range(3, 103)), 3)
    assert a.status is SequenceStatus.FINISHED_LENGTH


def test_decodes_are_batched_with_new_prefills() -> None:
    s = make(budget=16, max_seqs=2)
    for i in range(3):
        s.add(seq(f"r{i}", [5 + i] * 6, max_tokens=4))
    plans = run(s)
    assert plans[0] == [("r0", 0, 6), ("r1", 0, 6)]  # max_num_seqs=2 holds r2 back
    assert plans[1] == [("r0", 6, 1), ("r1", 6, 1)]
    assert ("r2", 0, 6) in plans[4]  # admitted once a slot frees


def test_preemption_by_recompute_gives_identical_tokens_and_frees_everything() -> None:
    prompts = [[7 + i] * (9 + 3 * i) for i in range(6)]
    reference = [expected_output(p, 12) for p in prompts]
    for caching in (True, False):
        s = make(num_blocks=12, block_size=4, budget=64, max_seqs=6, caching=caching)
        seqs = [seq(f"r{i}", p, max_tokens=12) for i, p in enumerate(prompts)]
        for q in seqs:
            s.add(q)
        run(s)
        assert s.num_preemptions > 0
        assert [q.output_token_ids for q in seqs] == reference
        assert set(s.block_manager.ref_counts()) == {0}
        assert s.block_manager.num_free_blocks == 12


def test_stop_conditions() -> None:
    s = make()
    prompt = [1, 2, 3]
    out = expected_output(prompt, 8)
    stop_at = out[2]
    a = seq("a", prompt, max_tokens=8, stop_token_ids=[stop_at])
    b = seq("b", prompt, max_tokens=2)
    s.add(a)
    s.add(b)
    run(s)
    assert a.output_token_ids == out[: out.index(stop_at) + 1] and a.stop_reason == stop_at
    assert a.status is SequenceStatus.FINISHED_STOPPED
    assert b.output_token_ids == out[:2] and b.status is SequenceStatus.FINISHED_LENGTH


def test_max_model_len_caps_generation() -> None:
    s = make(max_model_len=10)
    a = seq("a", [4] * 8, max_tokens=50)
    s.add(a)
    run(s)
    assert a.num_tokens == 10 and a.status is SequenceStatus.FINISHED_LENGTH


def test_impossible_requests_rejected_at_submit() -> None:
    s = make(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(ValueError, match="max_model_len=100"):
        s.add(seq("long", [1] * 101))
    with pytest.raises(ValueError, match="num_gpu_blocks=4"):
        s.add(seq("big", [1] * 15, max_tokens=4))  # 18 KV tokens > 16 slots
    with pytest.raises(ValueError, match="empty"):
        s.add(seq("empty", []))
    assert not s.has_unfinished()
    s.add(seq("fits", [1] * 15, max_tokens=2))  # 16 KV tokens: exactly fits


def test_abort_frees_blocks() -> None:
    s = make()
    a = seq("a", [3] * 20, max_tokens=100)
    s.add(a)
    out = s.schedule()
    s.update_from_output(out, [next_token(a.all_token_ids)])
    assert s.abort("a") is a and a.status is SequenceStatus.FINISHED_ABORTED
    assert set(s.block_manager.ref_counts()) == {0} and not s.has_unfinished()


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    max_tokens=st.integers(1, 10),
    num_blocks=st.integers(13, 40),
    budget=st.integers(1, 48),
    max_seqs=st.integers(1, 8),
)
def test_any_workload_completes_exactly(lens, max_tokens, num_blocks, budget, max_seqs) -> None:
    s = make(num_blocks=num_blocks, block_size=4, budget=budget, max_seqs=max_seqs)
    prompts = [[(i * 7 + j) % 50 + 3 for j in range(n)] for i, n in enumerate(lens)]
    seqs = [seq(f"r{i}", p, max_tokens=max_tokens) for i, p in enumerate(prompts)]
    for q in seqs:
        s.add(q)
    run(s)
    assert [q.output_token_ids for q in seqs] == [expected_output(p, max_tokens) for p in prompts]
    assert set(s.block_manager.ref_counts()) == {0}
    assert s.block_manager.num_free_blocks == num_blocks
