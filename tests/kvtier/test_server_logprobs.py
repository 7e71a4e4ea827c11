"""`kvtier serve`'s sampling API end to end with the official `openai` client: completions
logprobs (legacy shape), echo and scoring as lm-eval-harness calls it, n and best_of, chat
logprobs, penalties, logit_bias, min_tokens and prompt_logprobs, streamed and not, usage of
every choice, /tokenize and /detokenize; answers checked against `LLM.generate` on the same
weights."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from harness.serve import ENGINE_ARGS, NAME, ServeProcess, metrics

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(default_model_path: Path) -> Iterator[ServeProcess]:
    s = ServeProcess("--model", str(default_model_path), *ENGINE_ARGS)
    yield s
    assert s.stop() == 0, s.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def llm(default_model_path: Path) -> Iterator[LLM]:
    with LLM(str(default_model_path), device="cpu", dtype="float32", num_gpu_blocks=512) as llm:
        yield llm


def test_completion_logprobs_in_the_legacy_shape(client: openai.OpenAI, llm: LLM) -> None:
    got = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    (want,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=5, logprobs=3))
    w = want.outputs[0]
    lp = got.choices[0].logprobs
    assert lp is not None and got.choices[0].text == w.text
    assert lp.tokens == [llm.tokenizer.decode([t]) for t in w.token_ids]
    assert lp.token_logprobs == pytest.approx([pos[t].logprob for pos, t in zip(w.logprobs or [], w.token_ids)],
                                              abs=1e-5)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for top, pos in zip(lp.top_logprobs or [], w.logprobs or []):
        assert 3 <= len(top) <= 4  # the top 3 and the token itself
        assert max(top.values()) == pytest.approx(max(x.logprob for x in pos.values()), abs=1e-5)
    # streamed: the same tokens and logprobs, chunk by chunk, offsets continuing
    chunks = [c.choices[0] for c in client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, temperature=0,
                                                                logprobs=3, stream=True) if c.choices]
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert len(streamed) > 1
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.token_logprobs for s in streamed), []) == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    assert "".join(c.text for c in chunks) == got.choices[0].text


def test_echo_scoring_as_lm_eval_calls_it(client: openai.OpenAI, llm: LLM) -> None:
    ctx = llm.tokenizer.encode("Question: what is the capital of France? Answer:")
    conts = [llm.tokenizer.encode(" Paris"), llm.tokenizer.encode(" a small village by the sea")]
    prompts = [ctx + c for c in conts]
    # lm-eval's local-completions loglikelihood request: token ids, echo, logprobs=1, max_tokens=1
    got = client.completions.create(model=NAME, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0)
    assert [c.index for c in got.choices] == [0, 1]
    want = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    scores = []
    for choice, w, p in zip(got.choices, want, prompts):
        lp = choice.logprobs
        assert lp is not None and len(lp.tokens) == len(p) + 1  # the prompt, then one generated token
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert choice.text == llm.tokenizer.decode(p) + llm.tokenizer.decode(w.outputs[0].token_ids)
        prompt_lps = [w.prompt_logprobs[i][t].logprob for i, t in enumerate(p) if i]  # type: ignore[index]
        assert lp.token_logprobs[1:len(p)] == pytest.approx(prompt_lps, abs=1e-5)
        scores.append(sum(lp.token_logprobs[len(ctx):-1]))
    assert scores[0] > scores[1]  # " Paris" is the likelier continuation
    # max_tokens=0: the prompt alone, scored; again warm (prefix cached): identical, nothing reused
    zero = client.completions.create(model=NAME, prompt=prompts[0], echo=True, logprobs=2, max_tokens=0)
    again = client.completions.create(model=NAME, prompt=prompts[0], echo=True, logprobs=2, max_tokens=0)
    assert zero.choices[0].text == llm.tokenizer.decode(prompts[0]) and zero.usage.completion_tokens == 0
    assert zero.choices[0].logprobs.token_logprobs[1:] == pytest.approx(got.choices[0].logprobs.token_logprobs[1:-1],
                                                                        abs=1e-5)
    assert again.choices[0].logprobs == zero.choices[0].logprobs
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    # echo without logprobs: the prompt's text before the completion, no logprobs
    plain = client.completions.create(model=NAME, prompt=PROMPT, echo=True, max_tokens=4, temperature=0)
    assert plain.choices[0].text.startswith(PROMPT) and plain.choices[0].logprobs is None
    streamed = client.completions.create(model=NAME, prompt=PROMPT, echo=True, max_tokens=4, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == plain.choices[0].text


def test_n_and_best_of(client: openai.OpenAI, llm: LLM) -> None:
    kw = dict(model=NAME, max_tokens=6, temperature=0.9, seed=5, extra_body={"ignore_eos": True})
    got = client.completions.create(prompt=[PROMPT, "Once upon a time"], n=3, **kw)  # type: ignore[arg-type]
    assert [c.index for c in got.choices] == list(range(6))
    want = llm.generate([PROMPT, "Once upon a time"],
                        SamplingParams(temperature=0.9, seed=5, n=3, max_tokens=6, ignore_eos=True))
    assert [c.text for c in got.choices] == [c.text for w in want for c in w.outputs]
    assert got.usage.completion_tokens == 36
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    streamed = client.completions.create(prompt=[PROMPT, "Once upon a time"], n=3, stream=True,  # type: ignore[arg-type]
                                         stream_options={"include_usage": True}, **kw)
    texts = [""] * 6
    chunks = list(streamed)
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == [c.text for c in got.choices] and chunks[-1].usage.completion_tokens == 36
    # best_of: 4 samples, the 2 with the highest cumulative logprob, best first
    best = client.completions.create(prompt=PROMPT, n=2, best_of=4, logprobs=0, **kw)  # type: ignore[arg-type]
    (four,) = llm.generate(PROMPT, SamplingParams(temperature=0.9, seed=5, n=4, max_tokens=6, ignore_eos=True,
                                                  logprobs=0))
    ranked = sorted(four.outputs, key=lambda c: c.cumulative_logprob or 0.0, reverse=True)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert best.usage.completion_tokens == 24  # all four were generated
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt=PROMPT, n=2, best_of=4, stream=True, **kw)  # type: ignore[arg-type]
    assert e.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=PROMPT, n=2, temperature=0)
    assert e.value.body["param"] == "n"


def test_chat_logprobs_and_n(client: openai.OpenAI, llm: LLM) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=2)
    (want,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=6, logprobs=2))
    w = want.outputs[0]
    content = got.choices[0].logprobs.content
    assert [c.token for c in content] == [llm.tokenizer.decode([t]) for t in w.token_ids]
    assert [c.logprob for c in content] == pytest.approx([p[t].logprob for p, t in zip(w.logprobs or [], w.token_ids)],
                                                         abs=1e-5)
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.bytes == list(c.token.encode())
    streamed = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=2, stream=True)
    parts = [c.choices[0].logprobs.content for c in streamed if c.choices and c.choices[0].logprobs]
    assert [x.token for p in parts for x in p] == [c.token for c in content]
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None
    three = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=1.0, n=3,
                                           seed=1, extra_body={"ignore_eos": True})
    (want3,) = llm.chat(messages, SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=5, ignore_eos=True))
    assert [c.index for c in three.choices] == [0, 1, 2] and three.usage.completion_tokens == 15
    assert [c.message.content for c in three.choices] == [c.text for c in want3.outputs]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=messages, logprobs=True, top_logprobs=30)
    assert e.value.body["param"] == "top_logprobs"


def test_penalties_bias_and_prompt_logprobs_equal_the_engine(client: openai.OpenAI, llm: LLM) -> None:
    extra = {"repetition_penalty": 1.3, "min_tokens": 8, "min_p": 0.0, "prompt_logprobs": 2}
    got = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, presence_penalty=0.5,
                                    frequency_penalty=0.4, logit_bias={"7042": -100}, extra_body=extra)
    (want,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, presence_penalty=0.5,
                                                  frequency_penalty=0.4, logit_bias={7042: -100.0},
                                                  repetition_penalty=1.3, min_tokens=8, prompt_logprobs=2))
    assert got.choices[0].text == want.outputs[0].text and " Paris" not in got.choices[0].text
    pl = got.choices[0].model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(want.prompt_token_ids)
    for entry, w in zip(pl[1:], (want.prompt_logprobs or [])[1:]):
        assert w is not None and set(entry) == {str(t) for t in w}
        assert [v["logprob"] for v in entry.values()] == pytest.approx([x.logprob for x in w.values()], abs=1e-5)
    allowed = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0,
                                        extra_body={"allowed_token_ids": [7042, 30]})
    assert set(llm.tokenizer.encode(allowed.choices[0].text)) <= {7042, 30}
    for bad, param in (({"logprobs": 21}, "logprobs"), ({"max_tokens": 0}, "max_tokens"),
                       ({"frequency_penalty": 3}, "frequency_penalty"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                       ({"logit_bias": {"99999": 1}}, "logit_bias"), ({"n": 2, "best_of": 1}, "best_of"),
                       ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                       ({"min_tokens": 9, "max_tokens": 4}, "min_tokens")):
        r = httpx.post(str(client.base_url) + "completions", json={"prompt": PROMPT, **bad}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)


def test_tokenize_detokenize_models(server: ServeProcess, llm: LLM) -> None:
    url = server.url
    r = httpx.post(url + "/tokenize", json={"prompt": PROMPT, "return_token_strs": True}, timeout=60).json()
    assert r["tokens"] == llm.tokenizer.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 8192 and r["token_strs"] == llm.tokenizer.convert_ids_to_tokens(r["tokens"])
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(url + "/tokenize", json={"messages": messages}, timeout=60).json()
    rendered = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == llm.tokenizer.encode(rendered, add_special_tokens=False) and chat["token_strs"] is None
    back = httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}, timeout=60).json()
    assert back == {"prompt": PROMPT}
    bad = httpx.post(url + "/detokenize", json={"tokens": [10**9]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(url + "/tokenize", json={}, timeout=60).status_code == 400
    models = httpx.get(url + "/v1/models", timeout=60).json()["data"]
    assert models[0]["max_model_len"] == 8192


def test_metrics_count_every_sample(server: ServeProcess, client: openai.OpenAI) -> None:
    before = metrics(server.url)
    client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=1.0, n=2, seed=3,
                              extra_body={"ignore_eos": True})
    client.completions.create(model=NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    after = metrics(server.url)
    assert after["kvtier:generation_tokens_total"] - before["kvtier:generation_tokens_total"] == 8
    assert after["kvtier:request_success_total"] - before["kvtier:request_success_total"] == 3
    assert after["kvtier:e2e_request_latency_seconds_count"] - before["kvtier:e2e_request_latency_seconds_count"] == 2
    assert after["kvtier:time_to_first_token_seconds_count"] - before["kvtier:time_to_first_token_seconds_count"] == 1
