"""Automatic prefix caching on the real default model: same tokens, fewer computed ones."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from harness.text import long_text

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def llm_on(default_model_path: Path) -> Iterator[LLM]:
    with LLM(str(default_model_path), device="cpu", num_gpu_blocks=256) as llm:
        yield llm


@pytest.fixture(scope="module")
def llm_off(default_model_path: Path) -> Iterator[LLM]:
    with LLM(str(default_model_path), device="cpu", enable_prefix_caching=False, num_gpu_blocks=256) as llm:
        yield llm


@pytest.fixture(scope="module")
def shared_prompts(llm_on: LLM) -> list[dict]:
    """Four prompts sharing a ~400-token document prefix, each with its own question."""
    doc = llm_on.tokenizer.encode(long_text(10) + "\n\nQuestion: ")
    qs = ["What does the lighthouse keeper do?", "Where is the mill?", "How old are trees?", "What opens at dawn?"]
    return [{"prompt_token_ids": doc + llm_on.tokenizer.encode(q)} for q in qs], len(doc)


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]
    assert set(llm.engine.block_manager.ref_counts()) == {0}


def test_on_and_off_give_identical_tokens(llm_on: LLM, llm_off: LLM, shared_prompts) -> None:
    prompts, _ = shared_prompts
    off = [o.outputs[0].token_ids for o in llm_off.generate(prompts, GREEDY)]
    on_batch = [o.outputs[0].token_ids for o in llm_on.generate(prompts, GREEDY)]
    on_serial = [llm_on.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]  # warm
    assert on_batch == off and on_serial == off
    assert llm_off.get_stats()["prefix_cache_hits"] == 0
    assert_all_blocks_free(llm_on)
    assert_all_blocks_free(llm_off)


def test_num_cached_tokens_on_repeat_and_shared_prefix(llm_on: LLM, shared_prompts) -> None:
    prompts, doc_len = shared_prompts
    llm_on.reset_prefix_cache()
    before = llm_on.get_stats()
    first = llm_on.generate(prompts[0], GREEDY)[0]
    assert first.num_cached_tokens == 0
    n = len(first.prompt_token_ids)
    repeat = llm_on.generate(prompts[0], GREEDY)[0]
    # Every full block except one holding the last prompt token (always recomputed).
    assert repeat.num_cached_tokens == (n - 1) // 16 * 16 > 0
    assert repeat.outputs[0].token_ids == first.outputs[0].token_ids
    other = llm_on.generate(prompts[1], GREEDY)[0]
    assert other.num_cached_tokens == doc_len // 16 * 16
    after = llm_on.get_stats()
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == n + n + len(other.prompt_token_ids)
    assert (
        after["prefix_cache_hits"] - before["prefix_cache_hits"] == repeat.num_cached_tokens + other.num_cached_tokens
    )
    assert_all_blocks_free(llm_on)


def test_tiny_block_budget_forces_preemption_with_identical_tokens(default_model_path: Path, llm_off: LLM) -> None:
    tok = llm_off.tokenizer
    doc = tok.encode(long_text(12))
    prompts = [{"prompt_token_ids": doc[i * 40 : i * 40 + 60]} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm_off.generate(prompts, params)]
    for caching in (True, False):
        # 8 blocks of 16 = 128 slots: two 75-token requests cannot both stay resident.
        with LLM(str(default_model_path), device="cpu", num_gpu_blocks=8, enable_prefix_caching=caching) as small:
            outs = small.generate(prompts, params)
            assert [o.outputs[0].token_ids for o in outs] == want
            assert small.get_stats()["num_preemptions"] > 0
            assert sum(o.num_preemptions for o in outs) == small.get_stats()["num_preemptions"]
            assert_all_blocks_free(small)
