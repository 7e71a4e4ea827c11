"""`kvtier serve` end to end: real server processes on loopback, the official `openai` client,
answers checked against `LLM.generate` on the same weights (greedy, identical text)."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from connector.connector_metrics import PROM_COUNTERS
from engine import LLM, SamplingParams
from harness.polling import wait_until
from harness.serve import ENGINE_ARGS, NAME, ServeProcess, metrics
from harness.text import long_text

pytestmark = pytest.mark.slow


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
    llm = LLM(str(default_model_path), device="cpu", dtype="float32", num_gpu_blocks=512)
    yield llm
    llm.shutdown()


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "Three facts about owls:",
           "def fibonacci(n):", "Once upon a time", "The best way to learn a language is"]


def test_models_health_version(server: ServeProcess, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_greedy_completion_equals_llm_generate(client: openai.OpenAI, llm: LLM) -> None:
    for prompt in PROMPTS[:3]:
        got = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0)
        (want,) = llm.generate(prompt, greedy(16))
        assert got.choices[0].text == want.outputs[0].text
        assert got.choices[0].finish_reason == want.outputs[0].finish_reason
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    # token ids and a list of prompts: one choice per prompt, in order
    ids = llm.tokenizer.encode(PROMPTS[3])
    got = client.completions.create(model=NAME, prompt=[PROMPTS[4], PROMPTS[5]], max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0)
    want = llm.generate([PROMPTS[4], PROMPTS[5], {"prompt_token_ids": ids}], greedy(8))
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [w.outputs[0].text for w in want[:2]]
    assert by_ids.choices[0].text == want[2].outputs[0].text


def test_repeated_long_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    prompt = long_text(6)
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0)
    n = first.usage.prompt_tokens
    assert n > 200
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    assert second.choices[0].text == first.choices[0].text


def test_streamed_chat_equals_non_streamed(client: openai.OpenAI, llm: LLM) -> None:
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    full = client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 3  # streamed step by step, not in one piece
    assert "".join(content) == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    (want,) = llm.chat(messages, greedy(24))
    assert full.choices[0].message.content == want.outputs[0].text


def test_stop_strings(client: openai.OpenAI, llm: LLM) -> None:
    prompt = PROMPTS[2]
    (full,) = llm.generate(prompt, greedy(32, ignore_eos=True))
    text = full.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 4]
    got = client.completions.create(model=NAME, prompt=prompt, max_tokens=32, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == text[: text.index(stop)]
    assert got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=NAME, prompt=prompt, max_tokens=32, temperature=0, stop=stop,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text[: text.index(stop)]


def test_concurrent_clients_get_their_sequential_answers(client: openai.OpenAI) -> None:
    def ask(prompt: str) -> str:
        return client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0).choices[0].text

    sequential = [ask(p) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        concurrent_ = list(pool.map(ask, PROMPTS))
    assert concurrent_ == sequential


def test_bad_requests_get_openai_errors(server: ServeProcess, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="hi", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="greedy") as e:  # n > 1 needs sampling (vLLM)
        client.completions.create(model=NAME, prompt="hi", n=2, temperature=0)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError, match="longer than max_model_len=8192"):
        client.completions.create(model=NAME, prompt="hi " * 9000, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 8192") as e:
        client.completions.create(model=NAME, prompt="hi " * 8000, max_tokens=500)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="image input is not supported") as e:  # never dropped silently
        client.chat.completions.create(model=NAME, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}])
    assert e.value.body["param"] == "messages"
    # unknown fields are ignored, as OpenAI does
    r = httpx.post(
        server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "no_such_field": 1}, timeout=60
    )
    assert r.status_code == 200
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_lookup_and_reset_prefix_cache(server: ServeProcess, client: openai.OpenAI) -> None:
    prompt = "A lookup that no earlier test made. " + long_text(3)
    body = {"prompt": prompt}
    before = httpx.post(server.url + "/kv/lookup", json=body, timeout=60).json()
    assert before["engine_prefix_cache_tokens"] == 0 and before["tiers"] == {}
    client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    after = httpx.post(server.url + "/kv/lookup", json=body, timeout=60).json()
    assert after["engine_prefix_cache_tokens"] == (after["num_tokens"] - 1) // 16 * 16 > 0
    assert httpx.post(server.url + "/kv/reset_prefix_cache", timeout=60).json() == {"reset": True}
    assert httpx.post(server.url + "/kv/lookup", json=body, timeout=60).json()["engine_prefix_cache_tokens"] == 0
    r = httpx.post(server.url + "/kv/lookup", json={}, timeout=60)
    assert r.status_code == 400


def test_client_hanging_up_mid_stream_frees_everything(server: ServeProcess) -> None:
    body = {"prompt": long_text(2), "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few chunks, then hang up
    assert any(line.startswith("data: {") for line in got)
    wait_until(lambda: (m := metrics(server.url))["kvtier:num_requests_running"] == 0
               and m["kvtier:kv_cache_usage_perc"] == 0, 30.0, 0.2)
    m = metrics(server.url)
    assert m["kvtier:num_requests_running"] == 0 and m["kvtier:num_requests_waiting"] == 0
    assert m["kvtier:kv_cache_usage_perc"] == 0  # every block released
    assert m["kvtier:generation_tokens_total"] < 400 + 1000  # it stopped long before its 400 tokens
    assert m['kvtier:request_success_total'] > 0


def test_an_idle_keep_alive_connection_outlives_the_clients_expiry(server: ServeProcess) -> None:
    """A connection idle for 5.5 s (the openai client's httpx keeps one 5 s) still serves the next
    request: the server never closes it under a client that is about to reuse it."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        for i in range(2):
            sock.sendall(request)
            reply = sock.recv(65536)
            assert reply.startswith(b"HTTP/1.1 200"), (i, reply[:200])
            if i == 0:
                time.sleep(5.5)  # past uvicorn's default keep-alive (5 s)


def test_metrics_parse_and_move(server: ServeProcess, client: openai.OpenAI) -> None:
    before = metrics(server.url)
    client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = metrics(server.url)
    assert after["kvtier:generation_tokens_total"] - before["kvtier:generation_tokens_total"] == 5
    assert after["kvtier:prompt_tokens_total"] > before["kvtier:prompt_tokens_total"]
    assert after["kvtier:time_to_first_token_seconds_count"] == before["kvtier:time_to_first_token_seconds_count"] + 1
    assert after["kvtier:inter_token_latency_seconds_count"] == before["kvtier:inter_token_latency_seconds_count"] + 4
    assert after["kvtier:e2e_request_latency_seconds_count"] == before["kvtier:e2e_request_latency_seconds_count"] + 1
    assert after["kvtier:prefix_cache_queries_total"] > before["kvtier:prefix_cache_queries_total"]
    for name in ("kvtier:num_requests_running", "kvtier:num_requests_waiting", "kvtier:kv_cache_usage_perc",
                 "kvtier:prefix_cache_hits_total", "kvtier:num_preemptions_total"):
        assert name in after


def test_api_key_and_queue_bound(default_model_path: Path) -> None:
    s = ServeProcess("--model", str(default_model_path), "--device", "cpu", "--num-gpu-blocks", "128",
                     "--max-num-seqs", "1", "--max-queue", "0", env={"KVTIER_API_KEY": "s3cret"})
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert httpx.post(s.url + "/kv/lookup", json={"prompt": "x"}).status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200  # health and metrics stay open
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0, timeout=120)
        assert c.completions.create(model=NAME, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        long = c.completions.create(model=NAME, prompt="Count:", max_tokens=200, stream=True,
                                    extra_body={"ignore_eos": True})
        next(iter(long))  # it runs: one batch slot taken, no queue left
        with pytest.raises(openai.RateLimitError):
            c.completions.create(model=NAME, prompt="hi", max_tokens=2)
        long.close()
    finally:
        assert s.stop() == 0


def test_sigterm_flushes_stores_for_the_next_server(default_model_path: Path, tmp_path: Path) -> None:
    tier = ["--kv-tier", f"disk://{tmp_path}/kv", "--chunk-size", "64"]
    prompt = long_text(4)
    s = ServeProcess("--model", str(default_model_path), *ENGINE_ARGS, *tier)
    try:
        body = {"prompt": prompt, "max_tokens": 3, "temperature": 0}
        first = httpx.post(s.url + "/v1/completions", json=body, timeout=300).json()
    finally:
        assert s.stop() == 0, s.log()[-3000:]
    s2 = ServeProcess("--model", str(default_model_path), *ENGINE_ARGS, *tier)
    try:
        look = httpx.post(s2.url + "/kv/lookup", json={"prompt": prompt}, timeout=60).json()
        n = first["usage"]["prompt_tokens"]
        assert look["engine_prefix_cache_tokens"] == 0
        assert list(look["tiers"].values()) == [n - 1]  # every chunk stored, the last token excluded
        second = httpx.post(s2.url + "/v1/completions", json=body, timeout=300).json()
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        m = metrics(s2.url)
        assert m["kvtier:kv_connector_hit_tokens_total"] == n - 1
        assert all(f"{c.name}_total" in m for c in PROM_COUNTERS.values())  # vllm serve's names too
        assert m[f"kvtier:kv_tier_hit_tokens_total[{next(iter(look['tiers']))}]"] == n - 1  # as on vllm serve
        assert m["kvtier:kv_loaded_bytes_total"] > 0 and m["kvtier:kv_load_error_tokens_total"] == 0
        tier_name = next(iter(look["tiers"]))
        assert m[f"kvtier:kv_tier_loaded_bytes_total[{tier_name}]"] > 0
        assert m[f"kvtier:kv_tier_healthy[{tier_name}]"] == 1
    finally:
        assert s2.stop() == 0
    assert json.dumps(first)  # the first answer was a full JSON completion
