"""`vllm serve` with kvtier's connector across processes: a `kv_producer` stores a prompt in
Redis and the cache server and exits; fresh servers load it through each (Redis as a
`kv_consumer`, the cache server as `kv_both`), tested with the official `openai` client,
streamed and not; /metrics moves, and vLLM counts the loaded tokens as from an unspecified
external source (a shared tier). The three start side by side."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import vllm
from packaging.version import Version

from tests.fixtures.cache_server import CacheServerProcess
from tests.fixtures.redis_server import RedisServer
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


@dataclass
class Stored:
    """The loaders (started with the producer, asked nothing yet) and the cold run's tokens."""

    loaders: dict[str, VllmServer]
    cold: list[int]


@pytest.fixture(scope="module")
def stored(default_model_path: Path, redis_server_session: RedisServer, tmp_path_factory: pytest.TempPathFactory,
           prompt_2k: list[int]) -> Iterator[Stored]:
    """A `kv_producer` stores the prompt in Redis and the cache server, then exits; a
    `kv_consumer` over Redis and a `kv_both` over the cache server, started with it, have
    not run anything."""
    logs = tmp_path_factory.mktemp("vllm-serve")
    redis_server_session.client().flushall()
    cache = CacheServerProcess("--max-bytes", "256MiB")
    config = {"chunk_size": 256}
    producer, *loaders = start_together(
        lambda: VllmServer(default_model_path, config | {"tiers": [redis_server_session.url, cache.url]},
                           logs / "producer.log", "kv_producer"),
        lambda: VllmServer(default_model_path, config | {"tiers": [redis_server_session.url]},
                           logs / "consumer.log", "kv_consumer"),
        lambda: VllmServer(default_model_path, config | {"tiers": [cache.url]}, logs / "both.log", "kv_both"))
    try:
        try:
            # The request ends at its prefill, before its stores land; the pending stores keep
            # the engine stepping, so their counters reach /metrics with no further request.
            _complete(producer, prompt_2k, stream=False, max_tokens=1)
            _wait_for_metric(producer, "kvtier:stored_tokens_total", len(prompt_2k))
            cold = _complete(producer, prompt_2k, stream=False)
        finally:
            assert producer.close() == 0  # SIGINT: queued stores are flushed before it exits
        yield Stored(dict(zip(("redis", "kvtier"), loaders, strict=True)), cold)
    finally:
        for server in loaders:
            server.close()
        cache.kill()


@pytest.mark.parametrize("tier", ["redis", "kvtier"])
def test_a_fresh_server_loads_what_another_stored(tier: str, stored: Stored, prompt_2k: list[int]) -> None:
    """Redis: as kv_consumer; the cache server: as kv_both."""
    server = stored.loaders[tier]
    before = server.metrics()
    assert _complete(server, prompt_2k, stream=True) == stored.cold
    assert _complete(server, prompt_2k, stream=False) == stored.cold
    after = server.metrics()
    loaded = after.get("kvtier:connector_hit_tokens_total", 0) - before.get("kvtier:connector_hit_tokens_total", 0)
    assert loaded >= 2 * 0.9 * len(prompt_2k)
    if Version(vllm.__version__).release >= (0, 32):  # vLLM counts hits per source from 0.32 on
        by_source = "vllm:prompt_tokens_cached_by_source.external_unspecified"
        assert after.get(by_source, 0) - before.get(by_source, 0) == loaded
