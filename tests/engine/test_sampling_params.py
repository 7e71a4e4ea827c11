"""SamplingParams: vLLM's fields and validation (errors name the field), n > 1 sample params."""

from __future__ import annotations

import re

import pytest

from engine.sampling_params import MAX_LOGPROBS, SamplingParams


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), "n must be >= 1"),
        (dict(n=2, temperature=0.0), "n must be 1 when using greedy sampling"),
        (dict(n=1.5), "n must be an int"),
        (dict(max_tokens=0), "max_tokens must be >= 1 (0 only scores a prompt, with prompt_logprobs)"),
        (dict(max_tokens=0, prompt_logprobs=1, n=2), "n must be 1 when max_tokens=0"),
        (dict(max_tokens=-1, prompt_logprobs=1), "max_tokens must be >= 1"),
        (dict(min_tokens=-1), "min_tokens must be >= 0"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens must be <= max_tokens=4"),
        (dict(min_p=1.5), "min_p must be in [0, 1]"),
        (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
        (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2]"),
        (dict(frequency_penalty="1"), "frequency_penalty must be a number"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(logprobs=-1), f"logprobs must be in [0, {MAX_LOGPROBS}]"),
        (dict(logprobs=MAX_LOGPROBS + 1), "logprobs must be in"),
        (dict(prompt_logprobs=True), "prompt_logprobs must be an int"),
        (dict(logit_bias={"x": 1.0}), "logit_bias keys must be token ids"),
        (dict(logit_bias={5: "big"}), "logit_bias must map token ids to finite numbers"),
        (dict(logit_bias=[1, 2]), "logit_bias must be a mapping"),
        (dict(allowed_token_ids=[]), "allowed_token_ids must hold at least one token id"),
        (dict(allowed_token_ids=[-3]), "allowed_token_ids must be non-negative ints"),
    ],
)
def test_invalid_fields_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)


def test_valid_fields_and_conversions() -> None:
    p = SamplingParams(logit_bias={"17": 250, 3: -1.5}, allowed_token_ids=(1, 2), logprobs=0, prompt_logprobs=5)
    assert p.logit_bias == {17: 100.0, 3: -1.5}  # JSON's string keys become ids; biases clamped
    assert p.allowed_token_ids == [1, 2]
    assert p.skip_reading_prefix_cache and not SamplingParams().skip_reading_prefix_cache
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0  # scoring
    assert not SamplingParams().uses_history
    assert SamplingParams(min_tokens=1).uses_history and SamplingParams(repetition_penalty=1.1).uses_history
    with pytest.raises(ValueError, match=re.escape("logit_bias holds token id(s) [50000]")):
        SamplingParams(logit_bias={50000: 1.0}).verify_vocab(49152)
    with pytest.raises(ValueError, match="allowed_token_ids holds"):
        SamplingParams(allowed_token_ids=[49152]).verify_vocab(49152)
    SamplingParams(logit_bias={49151: 1.0}, allowed_token_ids=[0]).verify_vocab(49152)


def test_sample_params_derive_seeds_and_keep_prompt_logprobs_on_sample_zero() -> None:
    p = SamplingParams(n=3, seed=10, prompt_logprobs=2, stop=["x"])
    kids = [p.for_sample(i) for i in range(3)]
    assert [k.seed for k in kids] == [10, 11, 12] and {k.n for k in kids} == {1}
    assert [k.prompt_logprobs for k in kids] == [2, None, None]
    kids[1].stop.append("y")
    assert p.stop == ["x"]  # each sample owns its lists
    assert SamplingParams(n=2).for_sample(1).seed is None
