"""Faults under a real vLLM on a Redis tier: a corrupted value, a deleted chunk, Redis killed
before the lookup, and Redis killed between the lookup and the load. Tokens stay identical to
the cold run, errors are counted, blocks are freed, and the engine keeps serving.

The connector reaches Redis through a fault proxy (tests/fixtures/fault_proxy.py), a plain
pass-through until a test arms it: armed, it kills Redis just before the first value read
(GET) reaches it, after the lookup's existence checks (GETRANGE) were answered."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from connector.key_families import INDEX_KEY
from harness.redis import RedisServer
from harness.vllm import VllmLLM
from kvstore.deadlines import BACKOFF_MAX_S
from tests.fixtures.fault_proxy import FaultProxy

TOKENS = 768  # three chunks: what a fault does to a load needs several chunks, not a long prompt
CHUNKS = TOKENS // 256
KV_HEADS = 3  # the default model's (SmolLM2-135M): each chunk is one stored value per KV head


@pytest.fixture(scope="module")
def proxy(redis_server_session: RedisServer) -> Iterator[FaultProxy]:
    """The session's Redis as the connector sees it: passed through until a test arms it."""
    with FaultProxy(redis_server_session.port) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def llm(proxy: FaultProxy, default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmLLM]:
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    llm = VllmLLM(default_model_path, {"tiers": [proxy.url], "chunk_size": 256}, log)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def prompt(prompt_2k: list[int]) -> list[int]:
    return prompt_2k[:TOKENS]


def restore(redis: RedisServer) -> None:
    """Restarts Redis (empty) if a test killed it, then waits out the tier's longest backoff
    (kvstore/health.py): the connector's next lookup and store reach it instead of skipping it."""
    if not redis.alive():
        redis.restart()
        time.sleep(BACKOFF_MAX_S + 0.25)


def variant(prompt: list[int], i: int) -> list[int]:
    """The prompt with its first token changed: no chunk key in common with the others."""
    return [prompt[0] + 1 + i, *prompt[1:]]


def stored_keys(redis: RedisServer, before: set[bytes]) -> list[bytes]:
    """Waits (bounded) until the cold run's chunks reached Redis, every value of each (one per
    KV head, docs/vllm.md "Parallel"; not the key families index); returns their keys."""
    values = CHUNKS * KV_HEADS
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = [k for k in redis.client().keys("*") if k not in before and k != INDEX_KEY.encode()]
        if len(new) >= values:
            return new
        time.sleep(0.1)
    raise AssertionError(f"only {len(new)} of {values} values ({CHUNKS} chunks) reached Redis")


def scrub(llm: VllmLLM, prompt: list[int]) -> None:
    """Runs `prompt` reversed (as long, other K/V), storing nothing. With prefix caching off
    vLLM reuses freed blocks last in, first out, so the next request of that length gets these
    blocks: a load that failed unreported then shows as wrong tokens, instead of the blocks
    still holding the cold run's K/V by luck."""
    llm.generate([prompt[::-1]], max_tokens=1, kv_transfer_params={"kvtier.skip_save": True})


def run_with_fault(llm: VllmLLM, redis: RedisServer, prompt: list[int], fault,
                   scrubbed: bool = False) -> tuple[dict, dict, dict]:
    """Runs `prompt` cold, applies `fault(new keys)` (and `scrub`s the blocks), runs it again;
    returns (cold, warm, before warm)."""
    before = set(redis.client().keys("*"))
    cold = llm.generate([prompt])
    fault(stored_keys(redis, before))
    if scrubbed:
        scrub(llm, prompt)
    warm = llm.generate([prompt])
    return cold, warm, cold["metrics"]


def delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0) - before.get(name, 0)


def test_a_corrupted_value_is_recomputed_and_counted(llm: VllmLLM, redis_server_session: RedisServer,
                                                     prompt: list[int]) -> None:
    client = redis_server_session.client()

    def corrupt(keys: list[bytes]) -> None:
        for key in keys:  # every chunk: whichever the load reaches first is bad
            value = client.get(key)
            assert value is not None
            mid = len(value) // 2
            client.setrange(key, mid, bytes([value[mid] ^ 0xFF]))

    cold, warm, before = run_with_fault(llm, redis_server_session, variant(prompt, 0), corrupt, scrubbed=True)
    assert warm["outputs"][0]["tokens"] == cold["outputs"][0]["tokens"]
    assert delta(warm["metrics"], before, "kvtier:kv_load_error_tokens_total") > 0
    assert delta(warm["metrics"], before, "kvtier:kv_connector_hit_tokens_total") == 0
    assert warm["metrics"]["vllm:kv_cache_usage_perc"] == 0


def test_a_deleted_chunk_shortens_the_hit(llm: VllmLLM, redis_server_session: RedisServer,
                                          prompt: list[int]) -> None:
    client = redis_server_session.client()
    cold, warm, before = run_with_fault(llm, redis_server_session, variant(prompt, 1),
                                        lambda keys: client.delete(keys[0]))
    assert warm["outputs"][0]["tokens"] == cold["outputs"][0]["tokens"]
    loaded = delta(warm["metrics"], before, "kvtier:kv_connector_hit_tokens_total")
    assert loaded == warm["outputs"][0]["cached"] < len(prompt) - 1
    assert delta(warm["metrics"], before, "kvtier:kv_load_error_tokens_total") == 0


def test_redis_killed_is_a_miss_and_serving_goes_on(llm: VllmLLM, redis_server_session: RedisServer,
                                                    prompt: list[int]) -> None:
    try:
        cold, warm, before = run_with_fault(llm, redis_server_session, variant(prompt, 2),
                                            lambda keys: redis_server_session.kill())
        assert warm["outputs"][0]["tokens"] == cold["outputs"][0]["tokens"]
        assert warm["outputs"][0]["cached"] == 0
        again = llm.generate([variant(prompt, 3)], max_tokens=4)
        assert len(again["outputs"][0]["tokens"]) == 4
        assert again["metrics"]["vllm:kv_cache_usage_perc"] == 0
    finally:
        restore(redis_server_session)


def test_redis_killed_between_lookup_and_load_is_recomputed(llm: VllmLLM, proxy: FaultProxy,
                                                            redis_server_session: RedisServer,
                                                            prompt: list[int]) -> None:
    redis = redis_server_session
    restore(redis)
    ids = variant(prompt, 4)
    try:
        before = set(redis.client().keys("*"))
        cold = llm.generate([ids])
        stored_keys(redis, before)
        scrub(llm, ids)
        proxy.arm(["GET", "MGET"], redis.kill)  # the load's reads; the lookup's GETRANGEs pass
        warm = llm.generate([ids])
        assert proxy.fired.wait(10) and proxy.hook_error is None, "the load never read Redis"
        assert "GETRANGE" in proxy.seen_before_fire()  # the lookup asked the live Redis first
        assert not redis.alive()

        assert warm["outputs"][0]["tokens"] == cold["outputs"][0]["tokens"]
        promised = delta(warm["metrics"], cold["metrics"], "vllm:external_prefix_cache_hits")
        loaded = delta(warm["metrics"], cold["metrics"], "kvtier:kv_connector_hit_tokens_total")
        errors = delta(warm["metrics"], cold["metrics"], "kvtier:kv_load_error_tokens_total")
        assert promised == len(ids) - 1  # every chunk held at lookup; never the last token
        assert loaded == 0 < errors == promised  # Redis died before serving one value
        assert warm["metrics"]["vllm:kv_cache_usage_perc"] == 0

        during = llm.generate([variant(prompt, 5)[:320]], max_tokens=4)  # Redis still down
        assert len(during["outputs"][0]["tokens"]) == 4
        assert during["metrics"]["vllm:kv_cache_usage_perc"] == 0

        restore(redis)  # empty again: store, then load
        again_cold = llm.generate([ids])
        stored_keys(redis, set())
        again = llm.generate([ids])
        assert again["outputs"][0]["tokens"] == cold["outputs"][0]["tokens"]
        loaded = delta(again["metrics"], again_cold["metrics"], "kvtier:kv_connector_hit_tokens_total")
        assert loaded == again["outputs"][0]["cached"] == promised
        assert delta(again["metrics"], again_cold["metrics"], "kvtier:kv_load_error_tokens_total") == 0
    finally:
        proxy.disarm()
        restore(redis)
