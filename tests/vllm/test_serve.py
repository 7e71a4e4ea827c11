"""`vllm serve` with kvtier's connector across processes: one server stores, a fresh server
loads through a shared tier (Redis: as kv_producer then kv_consumer; the cache server: both
kv_both), tested with the official `openai` client, streamed and not; /metrics moves."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.fixtures.connector import tier_url
from tests.fixtures.vllm import VllmServer


def _client(server: VllmServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _complete(server: VllmServer, prompt: list[int], stream: bool) -> list[int]:
    """Returns the greedy completion's token ids (vLLM's `return_token_ids` extension)."""
    client = _client(server)
    body = {"return_token_ids": True, "ignore_eos": True}
    if not stream:
        out = client.completions.create(model="default", prompt=prompt, max_tokens=8, temperature=0.0,
                                        extra_body=body)
        return list(out.choices[0].token_ids)  # type: ignore[attr-defined]
    tokens: list[int] = []
    for event in client.completions.create(model="default", prompt=prompt, max_tokens=8, temperature=0.0,
                                           stream=True, extra_body=body):
        tokens += event.choices[0].token_ids or []  # type: ignore[attr-defined]
    return tokens


@pytest.fixture
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    yield tier_url(request.param, tmp_path, request)


@pytest.mark.parametrize(("tier", "roles"), [("redis", ("kv_producer", "kv_consumer")),
                                              ("kvtier", ("kv_both", "kv_both"))], indirect=["tier"])
def test_a_fresh_server_loads_what_another_stored(tier: str, roles: tuple[str, str], tmp_path: Path,
                                                  default_model_path: Path, prompt_2k: list[int]) -> None:
    config = {"tiers": [tier], "chunk_size": 256}
    first = VllmServer(default_model_path, config, tmp_path / "first.log", roles[0])
    try:
        cold = _complete(first, prompt_2k, stream=False)
    finally:
        assert first.close() == 0  # SIGINT: queued stores are flushed before it exits
    second = VllmServer(default_model_path, config, tmp_path / "second.log", roles[1])
    try:
        before = second.metrics()
        assert _complete(second, prompt_2k, stream=True) == cold
        assert _complete(second, prompt_2k, stream=False) == cold
        after = second.metrics()
    finally:
        second.close()
    loaded = after.get("kvtier:connector_hit_tokens_total", 0) - before.get("kvtier:connector_hit_tokens_total", 0)
    assert loaded >= 2 * 0.9 * len(prompt_2k)
