"""Logits processors (allowed tokens, min_tokens, logit bias, repetition / frequency / presence
penalties, min_p) against a straightforward per-token reference of vLLM's formulas, per row
of a mixed batch; end to end, greedy tokens with penalties equal transformers' logits run
through the reference."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.logits_processors import apply_allowed_and_bias, apply_min_p, apply_penalties
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams

V = 64
EOS = frozenset({2})


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams,
              stop_ids: frozenset[int] = EOS) -> torch.Tensor:
    """One row processed token by token, as vLLM's docs state each step (float64)."""
    x = logits.double().clone()
    if p.allowed_token_ids is not None:
        for t in range(x.shape[0]):
            if t not in p.allowed_token_ids:
                x[t] = float("-inf")
    if len(output) < p.min_tokens:
        for t in stop_ids | set(p.stop_token_ids):
            x[t] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def processed(logits: torch.Tensor, params: list[SamplingParams], hist: list) -> torch.Tensor:
    out = apply_allowed_and_bias(logits.clone(), params, hist, EOS)
    return apply_penalties(out, params, hist)


ROWS = [
    SamplingParams(temperature=0.0),  # asks for nothing: must stay bit-for-bit
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, repetition_penalty=0.7, frequency_penalty=0.5, presence_penalty=-0.4),
    SamplingParams(temperature=0.0, frequency_penalty=-1.0, presence_penalty=1.5, logit_bias={5: 3.0, 9: -100}),
    SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[7], max_tokens=8),
    SamplingParams(temperature=0.0, min_tokens=2, allowed_token_ids=[2, 3, 4, 5, 40], logit_bias={40: 1.0}),
]
HISTORIES = [([1, 2, 3], [4, 4]), ([3, 3, 10, 11], [10, 12, 12, 13]), ([5, 6], [6, 6, 6, 7, 20]),
             ([1], [5, 5, 9, 30]), ([8, 9], [1, 2]), ([4], [3])]


def test_each_row_matches_the_reference_and_plain_rows_are_untouched() -> None:
    logits = torch.randn(len(ROWS), V, generator=torch.Generator().manual_seed(0)) * 3
    got = processed(logits, ROWS, HISTORIES)
    assert torch.equal(got[0], logits[0])
    for i, (p, (prompt, output)) in enumerate(zip(ROWS, HISTORIES)):
        want = reference(logits[i], prompt, output, p)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), i
        finite = torch.isfinite(want)
        assert torch.allclose(got[i][finite].double(), want[finite], atol=1e-5), i
    # min_tokens: eos and the row's stop token masked while short of it, free once reached
    assert got[4, 2] == float("-inf") and got[4, 7] == float("-inf")
    after = processed(logits[4:5], [ROWS[4]], [([8, 9], [1, 2, 3, 4])])
    assert torch.isfinite(after).all()
    assert set(torch.isfinite(got[5]).nonzero().flatten().tolist()) == {3, 4, 5, 40}  # 2 is eos, held back


def test_sampler_greedy_uses_processed_logits_and_reports_raw_logprobs() -> None:
    logits = torch.randn(len(ROWS), V, generator=torch.Generator().manual_seed(1)) * 3
    params = [SamplingParams(**{**p.__dict__, "logprobs": 3}) for p in ROWS]
    out = Sampler(EOS).sample(logits, params, [None] * len(ROWS), HISTORIES)
    want = [int(reference(logits[i], *HISTORIES[i], ROWS[i]).argmax()) for i in range(len(ROWS))]
    assert out.token_ids.tolist() == want
    assert out.logprobs is not None and out.logprob_rows == list(range(len(ROWS)))
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(out.logprobs.logprobs[:, 0], raw.gather(1, torch.tensor(want)[:, None])[:, 0])
    assert torch.allclose(out.logprobs.logprobs[:, 1:], raw.topk(3, dim=-1).values)
    # asking for logprobs changes no token
    assert Sampler(EOS)(logits, list(ROWS), [None] * len(ROWS), HISTORIES).tolist() == want


def test_min_p_keeps_tokens_at_least_min_p_of_the_top() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04], [0.5, 0.3, 0.1, 0.06, 0.04]]))
    kept = torch.isfinite(apply_min_p(logits, torch.tensor([0.15, 0.0])))
    assert kept[0].tolist() == [True, True, True, False, False]  # 0.1 >= 0.075 > 0.06
    assert kept[1].all()


def test_seeded_penalised_rows_do_not_depend_on_neighbours() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=0.9, seed=5, repetition_penalty=1.2, presence_penalty=0.5, min_p=0.05)
    hist = ([1, 2], [3, 3])
    alone = Sampler(EOS)(logits[1:2], [p], [torch.Generator().manual_seed(5)], [hist]).item()
    batch = Sampler(EOS)(logits, [SamplingParams(temperature=0.0), p, SamplingParams(temperature=1.0)],
                         [None, torch.Generator().manual_seed(5), torch.Generator().manual_seed(9)],
                         [None, hist, None])
    assert batch[1].item() == alone


@pytest.fixture(scope="module")
def llm(default_model_path: Path) -> Iterator[LLM]:
    with LLM(str(default_model_path), device="cpu", dtype="float32", num_gpu_blocks=64) as llm:
        yield llm


@pytest.mark.slow
def test_penalised_greedy_tokens_equal_transformers_through_the_reference(llm: LLM, hf_default_model) -> None:
    prompt = llm.tokenizer.encode("List the days of the week: Monday, Tuesday, Monday, Tuesday,")
    eos = frozenset(llm.model_config.eos_token_ids)
    cases = [SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.4),
             SamplingParams(temperature=0.0, max_tokens=10, frequency_penalty=1.2, presence_penalty=0.6),
             SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10, logit_bias={11: 2.5, 28: -2.0},
                            repetition_penalty=0.9)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(cases), cases)  # one mixed batch
    for p, out in zip(cases, outs):
        ids, gen = list(prompt), []
        with torch.no_grad():
            for _ in range(p.max_tokens):
                logits = hf_default_model(torch.tensor([ids])).logits[0, -1]
                t = int(reference(logits, prompt, gen, p, eos).argmax())
                gen.append(t)
                ids.append(t)
                if t in eos and len(gen) >= p.min_tokens:
                    break
        assert out.outputs[0].token_ids == gen, p
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=10))[0]
    assert plain.outputs[0].token_ids != outs[0].outputs[0].token_ids  # the penalty changed something
