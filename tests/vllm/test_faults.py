"""Faults under a real vLLM on a Redis tier: a corrupted value, a deleted chunk, Redis killed.
Tokens stay identical to the cold run, errors are counted, blocks are freed, and the engine
keeps serving."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.redis_server import RedisServer
from tests.fixtures.vllm import VllmLLM

CHUNKS = 2048 // 256


@pytest.fixture(scope="module")
def llm(redis_server_session: RedisServer, default_model_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmLLM]:
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    llm = VllmLLM(default_model_path, {"tiers": [redis_server_session.url], "chunk_size": 256}, log)
    yield llm
    llm.close()


def variant(prompt: list[int], i: int) -> list[int]:
    """The prompt with its first token changed: no chunk key in common with the others."""
    return [prompt[0] + 1 + i, *prompt[1:]]


def stored_keys(redis: RedisServer, before: set[bytes]) -> list[bytes]:
    """Waits (bounded) until the cold run's chunks reached Redis; returns their keys."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = [k for k in redis.client().keys("*") if k not in before]
        if len(new) >= CHUNKS:
            return new
        time.sleep(0.1)
    raise AssertionError(f"only {len(new)} of {CHUNKS} chunks reached Redis")


def run_with_fault(llm: VllmLLM, redis: RedisServer, prompt: list[int], fault) -> tuple[dict, dict, dict]:
    """Runs `prompt` cold, applies `fault(new keys)`, runs it again; returns (cold, warm, before warm)."""
    before = set(redis.client().keys("*"))
    cold = llm.generate([prompt])
    fault(stored_keys(redis, before))
    warm = llm.generate([prompt])
    return cold, warm, cold["metrics"]


def delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0) - before.get(name, 0)


def test_a_corrupted_value_is_recomputed_and_counted(llm: VllmLLM, redis_server_session: RedisServer,
                                                     prompt_2k: list[int]) -> None:
    client = redis_server_session.client()

    def corrupt(keys: list[bytes]) -> None:
        for key in keys:  # every chunk: whichever the load reaches first is bad
            value = client.get(key)
            assert value is not None
            mid = len(value) // 2
            client.setrange(key, mid, bytes([value[mid] ^ 0xFF]))

    cold, warm, before = run_with_fault(llm, redis_server_session, variant(prompt_2k, 0), corrupt)
    assert warm["outputs"][0]["tokens"] == cold["outputs"][0]["tokens"]
    assert delta(warm["metrics"], before, "kvtier:load_error_tokens_total") > 0
    assert delta(warm["metrics"], before, "kvtier:connector_hit_tokens_total") == 0
    assert warm["metrics"]["vllm:kv_cache_usage_perc"] == 0


def test_a_deleted_chunk_shortens_the_hit(llm: VllmLLM, redis_server_session: RedisServer,
                                          prompt_2k: list[int]) -> None:
    client = redis_server_session.client()
    cold, warm, before = run_with_fault(llm, redis_server_session, variant(prompt_2k, 1),
                                        lambda keys: client.delete(keys[0]))
    assert warm["outputs"][0]["tokens"] == cold["outputs"][0]["tokens"]
    loaded = delta(warm["metrics"], before, "kvtier:connector_hit_tokens_total")
    assert loaded == warm["outputs"][0]["cached"] < 2047
    assert delta(warm["metrics"], before, "kvtier:load_error_tokens_total") == 0


def test_redis_killed_is_a_miss_and_serving_goes_on(llm: VllmLLM, redis_server_session: RedisServer,
                                                    prompt_2k: list[int]) -> None:
    try:
        cold, warm, before = run_with_fault(llm, redis_server_session, variant(prompt_2k, 2),
                                            lambda keys: redis_server_session.kill())
        assert warm["outputs"][0]["tokens"] == cold["outputs"][0]["tokens"]
        assert warm["outputs"][0]["cached"] == 0
        again = llm.generate([variant(prompt_2k, 3)], max_tokens=4)
        assert len(again["outputs"][0]["tokens"]) == 4
        assert again["metrics"]["vllm:kv_cache_usage_perc"] == 0
    finally:
        if not redis_server_session.alive():
            redis_server_session.restart()
