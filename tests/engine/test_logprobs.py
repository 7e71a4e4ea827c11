"""Logprobs on the real default model (fp32): generated-token and prompt logprobs equal
transformers' log_softmax, across chunked-prefill chunks and preemption; asking for them
changes no token; prompt logprobs skip the prefix cache and equal a cold run; scoring with
max_tokens=0; n samples per request, reproducible with a seed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import LLM, RequestOutput, SamplingParams
from harness.text import long_text

pytestmark = pytest.mark.slow
K = 5


@pytest.fixture(scope="module")
def llm(default_model_path: Path) -> Iterator[LLM]:
    # A 64-token step budget: the prompts below prefill in several chunks.
    with LLM(str(default_model_path), device="cpu", dtype="float32", num_gpu_blocks=128,
             max_num_batched_tokens=64) as llm:
        yield llm


@pytest.fixture(scope="module")
def prompt(llm: LLM) -> list[int]:
    ids = llm.tokenizer.encode(long_text(4))
    assert len(ids) > 2 * 64
    return ids


def scored(llm: LLM, prompt: list[int], **kw: object) -> RequestOutput:
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=K, prompt_logprobs=K, **kw)  # type: ignore[arg-type]
    return llm.generate({"prompt_token_ids": prompt}, params)[0]


def flat(out: RequestOutput) -> torch.Tensor:
    """Every logprob value of an output (prompt then generated), in order, for comparing runs."""
    vals = [lp.logprob for pos in (out.prompt_logprobs or [])[1:] for lp in pos.values()]  # type: ignore[union-attr]
    vals += [lp.logprob for pos in out.outputs[0].logprobs or [] for lp in pos.values()]
    return torch.tensor(vals, dtype=torch.float64)


def assert_blocks_free(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]


def test_logprobs_equal_transformers_log_softmax(llm: LLM, prompt: list[int], hf_default_model) -> None:
    llm.reset_prefix_cache()
    out = scored(llm, prompt)
    gen = out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_default_model(torch.tensor([prompt + gen])).logits[0].double(), dim=-1)
    pl = out.prompt_logprobs
    assert pl is not None and len(pl) == len(prompt) and pl[0] is None
    positions = [(p, prompt[p], pl[p]) for p in range(1, len(prompt))]
    positions += [(len(prompt) + j, t, out.outputs[0].logprobs[j]) for j, t in enumerate(gen)]  # type: ignore[index]
    for pos, tok, entry in positions:
        row = ref[pos - 1]
        assert entry is not None and next(iter(entry)) == tok  # the position's own token first
        own = entry[tok]
        assert abs(own.logprob - float(row[tok])) <= 1e-4, pos
        assert int((row > own.logprob + 1e-4).sum()) < own.rank <= int((row >= own.logprob - 1e-4).sum())
        assert own.decoded_token == llm.tokenizer.decode([tok])
        top = sorted((lp for t, lp in entry.items() if lp.rank is not None and (t != tok or lp.rank <= K)),
                     key=lambda lp: lp.rank or 0)[-K:]
        assert [lp.rank for lp in top] == list(range(1, K + 1))
        assert torch.allclose(torch.tensor([lp.logprob for lp in top], dtype=torch.float64),
                              row.topk(K).values, atol=1e-4), pos
    assert gen == [int(ref[len(prompt) - 1 + j].argmax()) for j in range(len(gen))]
    cumulative = sum(out.outputs[0].logprobs[j][t].logprob for j, t in enumerate(gen))  # type: ignore[index]
    assert out.outputs[0].cumulative_logprob == pytest.approx(cumulative)


def test_asking_for_logprobs_changes_no_token_in_a_mixed_batch(llm: LLM, prompt: list[int]) -> None:
    p = {"prompt_token_ids": prompt[:40]}
    q = {"prompt_token_ids": prompt[20:70]}
    plain = [SamplingParams(temperature=0.0, max_tokens=8),
             SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3),
             SamplingParams(temperature=0.8, seed=7, max_tokens=8, top_k=20)]
    asking = [SamplingParams(**{**s.__dict__, "logprobs": 3, "prompt_logprobs": 1}) for s in plain]
    batch = llm.generate([p, q, q, p, q, q], plain + asking)
    tokens = [o.outputs[0].token_ids for o in batch]
    assert tokens[:3] == tokens[3:]
    assert [o.outputs[0].logprobs for o in batch[:3]] == [None] * 3 and batch[0].prompt_logprobs is None
    assert all(len(o.outputs[0].logprobs or []) == len(o.outputs[0].token_ids) for o in batch[3:])
    alone = llm.generate(q, plain[2])[0].outputs[0].token_ids
    assert alone == tokens[2]
    assert_blocks_free(llm)


def test_prompt_logprobs_skip_the_prefix_cache_and_equal_a_cold_run(llm: LLM, prompt: list[int]) -> None:
    # 129 tokens: the cold 64-token chunked prefill computes the last token alone, as the warm
    # run does after its 128-token hit, so only where the reused K/V came from differs.
    ids = {"prompt_token_ids": prompt[:129]}
    llm.reset_prefix_cache()
    cold = scored(llm, ids["prompt_token_ids"])
    llm.reset_prefix_cache()
    sample_only = SamplingParams(temperature=0.0, max_tokens=6, logprobs=K)
    cold_sample = llm.generate(ids, sample_only)[0]  # fills the cache
    assert cold_sample.num_cached_tokens == 0
    before = llm.get_stats()
    warm = scored(llm, ids["prompt_token_ids"])
    after = llm.get_stats()
    assert warm.num_cached_tokens == 0  # every prompt position computed
    assert after["prefix_cache_queries"] == before["prefix_cache_queries"]  # it did not look
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert (flat(warm) - flat(cold)).abs().max() <= 1e-5
    # generated-token logprobs from a prefix-cache hit equal a cold run's
    warm_sample = llm.generate(ids, sample_only)[0]
    assert warm_sample.num_cached_tokens == 128
    assert warm_sample.outputs[0].token_ids == cold_sample.outputs[0].token_ids
    assert (flat(warm_sample) - flat(cold_sample)).abs().max() <= 1e-5
    assert_blocks_free(llm)


def test_max_tokens_zero_scores_the_prompt(llm: LLM, prompt: list[int]) -> None:
    full = scored(llm, prompt[:50])
    out = llm.generate({"prompt_token_ids": prompt[:50]}, SamplingParams(max_tokens=0, prompt_logprobs=K))[0]
    assert out.finished and out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    assert out.prompt_logprobs == full.prompt_logprobs
    assert_blocks_free(llm)


def test_n_samples_are_reproducible_and_equal_single_requests_with_derived_seeds(llm: LLM,
                                                                              prompt: list[int]) -> None:
    p = {"prompt_token_ids": prompt[:60]}
    params = SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=8, logprobs=0, ignore_eos=True)
    first, greedy = llm.generate([p, p], [params, SamplingParams(temperature=0.0, max_tokens=4)])
    again = llm.generate(p, params)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2] and first.finished
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    singles = llm.generate([p] * 3, [SamplingParams(**{**params.__dict__, "n": 1, "seed": 11 + i})
                                     for i in range(3)])
    assert [c.token_ids for c in first.outputs] == [s.outputs[0].token_ids for s in singles]
    assert [c.cumulative_logprob for c in first.outputs] == [s.outputs[0].cumulative_logprob for s in singles]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # three draws, not one copied
    unseeded = llm.generate(p, SamplingParams(temperature=1.0, n=4, max_tokens=8, ignore_eos=True))[0]
    assert len(unseeded.outputs) == 4 and len({tuple(c.token_ids) for c in unseeded.outputs}) > 1
    assert len(greedy.outputs) == 1 and llm.engine.parents.__len__() == 0
    # an aborted n > 1 request releases every sample
    rid = llm.engine.add_request(p, SamplingParams(temperature=1.0, n=3, max_tokens=50))
    llm.engine.step()
    llm.engine.abort_request(rid)
    assert not llm.engine.has_unfinished_requests() and len(llm.engine.parents) == 0
    assert_blocks_free(llm)


def test_logprobs_survive_preemption(default_model_path: Path, llm: LLM, prompt: list[int]) -> None:
    prompts = [{"prompt_token_ids": prompt[i * 30: i * 30 + 20]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    want = llm.generate(prompts, params)
    # 7 blocks of 16: all three are admitted (2 blocks each), then cannot all grow to 3
    with LLM(str(default_model_path), device="cpu", dtype="float32", num_gpu_blocks=7) as small:
        got = small.generate(prompts, params)
        assert small.get_stats()["num_preemptions"] > 0
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.outputs[0].logprobs or []) == 16
        # Recomputed as one prefill where the first run decoded token by token: another
        # summation order, so the transformers bound, not the cache paths' 1e-5.
        assert (flat(g) - flat(w)).abs().max() <= 1e-4
