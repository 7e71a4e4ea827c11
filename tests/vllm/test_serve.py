"""`vllm serve` with kvtier's connector across processes: one server stores, a fresh server
loads through a shared tier (Redis: as kv_producer then kv_consumer; the cache server: both
kv_both), tested with the official `openai` client, streamed and not; /metrics moves, and vLLM
counts the loaded tokens as from an unspecified external source (a shared tier)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import vllm
from packaging.version import Version

from tests.fixtures.connector import tier_url
from tests.fixtures.vllm import VllmServer, start_together


def _client(server: VllmServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _complete(server: VllmServer, prompt: list[int], stream: bool, max_tokens: int = 8) -> list[int]:
    """Returns the greedy completion's token ids (vLLM's `return_token_ids` extension)."""
    client = _client(server)
    body = {"return_token_ids": True, "ignore_eos": True}
    if not stream:
        out = client.completions.create(model="default", prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                        extra_body=body)
        return list(out.choices[0].token_ids)  # type: ignore[attr-defined]
    tokens: list[int] = []
    for event in client.completions.create(model="default", prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                           stream=True, extra_body=body):
        tokens += event.choices[0].token_ids or []  # type: ignore[attr-defined]
    return tokens


def _wait_for_metric(server: VllmServer, name: str, at_least: float, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while (value := server.metrics().get(name, 0)) < at_least:
        assert time.monotonic() < deadline, f"{name} stayed at {value} (< {at_least}) for {timeout} s"
        time.sleep(0.2)


@pytest.fixture
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    yield tier_url(request.param, tmp_path, request)


@pytest.mark.parametrize(("tier", "roles"), [("redis", ("kv_producer", "kv_consumer")),
                                              ("kvtier", ("kv_both", "kv_both"))], indirect=["tier"])
def test_a_fresh_server_loads_what_another_stored(tier: str, roles: tuple[str, str], tmp_path: Path,
                                                  default_model_path: Path, prompt_2k: list[int]) -> None:
    config = {"tiers": [tier], "chunk_size": 256}
    # Both start side by side; the second is asked nothing until the first stored and exited.
    first, second = start_together(lambda: VllmServer(default_model_path, config, tmp_path / "first.log", roles[0]),
                                   lambda: VllmServer(default_model_path, config, tmp_path / "second.log", roles[1]))
    try:
        try:
            if roles[0] == "kv_producer":
                # The request ends at its prefill, before its stores land; the pending stores keep
                # the engine stepping, so their counters reach /metrics with no further request.
                _complete(first, prompt_2k, stream=False, max_tokens=1)
                _wait_for_metric(first, "kvtier:stored_tokens_total", len(prompt_2k))
            cold = _complete(first, prompt_2k, stream=False)
        finally:
            assert first.close() == 0  # SIGINT: queued stores are flushed before it exits
        before = second.metrics()
        assert _complete(second, prompt_2k, stream=True) == cold
        assert _complete(second, prompt_2k, stream=False) == cold
        after = second.metrics()
    finally:
        second.close()
    loaded = after.get("kvtier:connector_hit_tokens_total", 0) - before.get("kvtier:connector_hit_tokens_total", 0)
    assert loaded >= 2 * 0.9 * len(prompt_2k)
    if Version(vllm.__version__).release >= (0, 32):  # vLLM counts hits per source from 0.32 on
        by_source = "vllm:prompt_tokens_cached_by_source.external_unspecified"
        assert after.get(by_source, 0) - before.get(by_source, 0) == loaded
