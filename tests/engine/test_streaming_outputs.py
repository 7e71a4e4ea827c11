"""`step()` reports every request that progressed (real streaming), incremental detokenization
agrees with one full decode, and stop strings cut the text where they start."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.detokenizer import find_stop_string

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "Write a haiku about autumn leaves.", "List three prime numbers:"]


@pytest.fixture(scope="module")
def llm(default_model_path: Path) -> Iterator[LLM]:
    with LLM(str(default_model_path), device="cpu", dtype="float32", num_gpu_blocks=256) as llm:
        yield llm


def test_step_reports_requests_in_progress(llm: LLM) -> None:
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in PROMPTS]
    seen: dict[str, list] = {i: [] for i in ids}
    while eng.has_unfinished_requests():
        for o in eng.step():
            seen[o.request_id].append(o)
    for rid in ids:
        outs = seen[rid]
        assert len(outs) == 12  # one output per generated token, not only the last
        assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 13))
        assert [o.finished for o in outs] == [False] * 11 + [True]
        texts = [o.outputs[0].text for o in outs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
        final = outs[-1].outputs[0]
        assert final.finish_reason == "length" and outs[0].outputs[0].finish_reason is None
        # the incrementally built text is exactly one full decode of the tokens
        assert final.text == llm.tokenizer.decode(final.token_ids, skip_special_tokens=True)
    assert llm.get_stats()["num_free_blocks"] == llm.get_stats()["num_gpu_blocks"]


def test_stop_string_cuts_text_and_finishes(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (full,) = llm.generate(PROMPTS[1], greedy)
    text = full.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text
    cut = text.index(stop)
    (out,) = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                     stop=[stop, "never-in-the-text"]))
    c = out.outputs[0]
    assert c.text == text[:cut]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert len(c.token_ids) < len(full.outputs[0].token_ids)  # stopped early, blocks freed
    assert full.outputs[0].token_ids[: len(c.token_ids)] == c.token_ids
    (kept,) = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                      stop=stop, include_stop_str_in_output=True))
    assert kept.outputs[0].text == text[: cut + len(stop)]
    assert llm.get_stats()["num_free_blocks"] == llm.get_stats()["num_gpu_blocks"]


def test_find_stop_string_sees_matches_across_steps() -> None:
    assert find_stop_string("hello wor", 3, ["world"]) is None
    assert find_stop_string("hello world!", 3, ["world"]) == (6, "world")  # "ld!" completes it
    assert find_stop_string("ab stop cd", 2, ["stop"]) is None  # earlier text was checked before
    assert find_stop_string("x END y STOP", 12, ["STOP", "END"]) == (2, "END")  # earliest wins


def test_bad_stop_is_rejected() -> None:
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[""])
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[3])  # type: ignore[list-item]
