"""`vllm serve` with kvtier's connector across processes: disaggregated prefill across tensor
parallel sizes. A `kv_producer` with two tensor-parallel workers (each stores its KV heads)
stores a prompt in Redis and the cache server and exits; fresh single-worker servers load it
through each (Redis as a `kv_consumer`, the cache server as `kv_both`) with their own cold
run's tokens, tested with the official `openai` client, streamed and not; /metrics moves, and
vLLM counts the loaded tokens as from an unspecified external source (a shared tier). The
servers run one tiny StableLM (4 KV heads: two per producer rank). A fourth vLLM (an `LLM`,
one process, the same model) publishes the KV events of its tier. The four start side by
side; the loaders run vLLM's worker in their engine core's process (one process import less to
start: harness/vllm.py), the producer vLLM's default layout with two workers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import vllm
from packaging.version import Version
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from harness.cache_server import CacheServerProcess
from harness.model import make_tiny_checkpoint
from harness.redis import RedisServer
from harness.vllm import VllmLLM, VllmServer, close_together, start_together
from tests.fixtures.vllm import collect_kv_events

CHUNK = 256
SHARED = 1024  # the prompt's tokens the producer stores for the fresh servers: four chunks
# The servers' model: 4 KV heads, so the TP=2 producer's ranks hold two each; the default
# model's vocabulary, so they read prompt_2k (the consumers key it from vLLM's view of it).
TINY = dict(model_type="stablelm", hidden_size=128, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=4, num_hidden_layers=4, max_position_embeddings=4096, vocab_size=49152)
SKIP_SAVE = {"kv_transfer_params": {"kvtier.skip_save": True}}


def _client(server: VllmServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _complete(server: VllmServer, prompt: list[int], stream: bool, max_tokens: int = 8,
              extra: dict[str, object] | None = None) -> list[int]:
    """Returns the greedy completion's token ids (vLLM's `return_token_ids` extension)."""
    client = _client(server)
    body = {"return_token_ids": True, "ignore_eos": True, **(extra or {})}
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
class Servers:
    """The module's servers, started side by side: the loaders (asked only for their cold run,
    stored nowhere, before the producer ran), the events server and its endpoint, and each
    loader's cold tokens."""

    loaders: dict[str, VllmServer]
    events: VllmLLM
    endpoint: str
    cold: dict[str, list[int]]


@pytest.fixture(scope="module")
def servers(default_model_path: Path, redis_server_session: RedisServer, tmp_path_factory: pytest.TempPathFactory,
            prompt_2k: list[int]) -> Iterator[Servers]:
    """A TP=2 `kv_producer` stores the prompt in Redis and the cache server, then exits; a
    `kv_consumer` over Redis and a `kv_both` over the cache server ran it cold before, storing
    nothing; a fourth vLLM publishes KV events from a `cpu` tier of 3 chunks."""
    logs = tmp_path_factory.mktemp("vllm-serve")
    model = make_tiny_checkpoint(logs, tokenizer_dir=default_model_path, **TINY)
    redis_server_session.client().flushall()
    cache = CacheServerProcess("--max-bytes", "256MiB")
    endpoint = f"ipc://{logs}/events.sock"  # vLLM's publisher binds it: local, no network
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    config = {"chunk_size": CHUNK}
    producer, consumer, both, events = start_together(
        lambda: VllmServer(model, config | {"tiers": [redis_server_session.url, cache.url]},
                           logs / "producer.log", "kv_producer", "--tensor-parallel-size", "2",
                           env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}),
        lambda: VllmServer(model, config | {"tiers": [redis_server_session.url]},
                           logs / "consumer.log", "kv_consumer", worker_in_engine=True),
        lambda: VllmServer(model, config | {"tiers": [cache.url]}, logs / "both.log", "kv_both",
                           worker_in_engine=True),
        # room for 3 of the prompt's 8 chunks (4096 bytes per token in fp32, 1 MiB a chunk): the rest are evicted
        lambda: VllmLLM(model, config | {"tiers": ["cpu?budget=3300KiB"]}, logs / "events.log",
                        kv_events=events_config))
    assert isinstance(producer, VllmServer) and isinstance(consumer, VllmServer) and isinstance(both, VllmServer)
    assert isinstance(events, VllmLLM)
    loaders = {"redis": consumer, "kvtier": both}
    try:
        try:
            cold = {tier: _complete(s, prompt_2k[:SHARED], stream=False, extra=SKIP_SAVE)
                    for tier, s in loaders.items()}
            # The request ends at its prefill, before its stores land; the pending stores keep
            # the engine stepping, so their counters reach /metrics with no further request.
            _complete(producer, prompt_2k[:SHARED], stream=False, max_tokens=1)
            _wait_for_metric(producer, "kvtier:kv_stored_tokens_total", SHARED)
        finally:
            assert producer.close() == 0  # SIGINT: queued stores are flushed before it exits
        assert "KV heads (2, 4) of rank 1" in producer.log.read_text(errors="replace")
        yield Servers(loaders, events, endpoint, cold)
    finally:
        close_together(consumer, both, events)
        cache.kill()


@pytest.mark.parametrize("tier", ["redis", "kvtier"])
def test_a_fresh_server_loads_what_another_stored(tier: str, servers: Servers, prompt_2k: list[int]) -> None:
    """Redis: as kv_consumer; the cache server: as kv_both. Each at TP=1, from the TP=2
    producer's per-head values."""
    server = servers.loaders[tier]
    before = server.metrics()
    assert _complete(server, prompt_2k[:SHARED], stream=True) == servers.cold[tier]
    assert _complete(server, prompt_2k[:SHARED], stream=False) == servers.cold[tier]
    after = server.metrics()
    hits = "kvtier:kv_connector_hit_tokens_total"
    loaded = after.get(hits, 0) - before.get(hits, 0)
    assert loaded >= 2 * 0.9 * SHARED
    if Version(vllm.__version__).release >= (0, 32):  # vLLM counts hits per source from 0.32 on
        by_source = "vllm:prompt_tokens_cached_by_source.external_unspecified"
        assert after.get(by_source, 0) - before.get(by_source, 0) == loaded


def test_stored_and_evicted_chunks_are_published(servers: Servers, prompt_2k: list[int]) -> None:
    """KV events from kvtier's tiers (vLLM's `kv_events_config`, `--kv-events-config` on
    `vllm serve`): each chunk the connector stores is published as vLLM's `BlockStored` with
    its tokens, its chained hash and the previous chunk's as parent, the tier as medium; each
    chunk the tier evicts as `BlockRemoved`.
    Received over vLLM's own ZMQ publisher, decoded with vLLM's event types."""
    events = collect_kv_events(servers.events, servers.endpoint,
                               lambda: servers.events.generate([prompt_2k], max_tokens=1), want=8 + 5)
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert len(stored) >= 8, events
    prompt_chunks = [prompt_2k[i:i + CHUNK] for i in range(0, len(prompt_2k), CHUNK)]
    assert [e.token_ids for e in stored[:8]] == prompt_chunks
    assert all(e.medium == "cpu" and e.block_size == CHUNK and len(e.block_hashes) == 1 for e in stored[:8])
    assert stored[0].parent_block_hash is None
    assert [e.parent_block_hash for e in stored[1:8]] == [e.block_hashes[0] for e in stored[:7]]
    assert len({e.block_hashes[0] for e in stored[:8]}) == 8
    # the budget holds 3 chunks: at least 5 of the 8 were evicted, each one announced before
    assert len(removed) >= 5
    announced = {e.block_hashes[0] for e in stored}
    assert all(e.medium == "cpu" and e.block_hashes[0] in announced for e in removed)
