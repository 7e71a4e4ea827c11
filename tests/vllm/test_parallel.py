"""Tensor parallel in a real vLLM with kvtier's connector: each of two worker processes (one core
each) stores and loads its own KV heads, a repeated prompt loads from the ranks' cpu tiers
with the cold run's tokens and logprobs, and chunks cross tensor-parallel sizes over a shared
Redis tier both ways: what a TP=2 vLLM stored, a TP=1 vLLM loads, and the reverse, each
giving its own cold run's tokens. A rank whose load fails reports it, and vLLM recomputes."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_events import BlockStored

from harness.model import make_tiny_checkpoint
from harness.polling import wait_until
from harness.redis import RedisServer
from harness.vllm import VllmLLM, close_together, start_together
from tests.fixtures.vllm import collect_kv_events

PROMPT = 1500
CHUNK = 256
HEADS = 4  # KV heads (no grouped queries): two per rank at TP=2
# StableLM: an architecture vLLM runs and kvtier's engine does not (the connector keys any model
# vLLM serves from vLLM's own view of it: connector/vllm/setup.py, `vllm_model`).
TINY = dict(model_type="stablelm", hidden_size=128, intermediate_size=256, num_attention_heads=HEADS,
            num_key_value_heads=HEADS, num_hidden_layers=4, max_position_embeddings=4096, vocab_size=1000)
SKIP_SAVE = {"kvtier.skip_save": True}


@pytest.fixture(scope="module")
def tp_llms(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path,
            redis_server_session: RedisServer) -> Iterator[dict[int, VllmLLM]]:
    """A TP=2 and a TP=1 vLLM of one tiny StableLM, each with its own cpu tier over one Redis;
    the TP=2 one publishes KV events at `tmp/events.sock` (`events_endpoint`)."""
    tmp = tmp_path_factory.mktemp("tp")
    model = make_tiny_checkpoint(tmp, tokenizer_dir=default_model_path, **TINY)
    config = {"tiers": ["cpu", redis_server_session.url], "chunk_size": CHUNK}

    def starter(tp: int) -> Any:
        env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tp == 2 else {}
        events = {"kv_events": {"enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": events_endpoint(tmp_path_factory)}} if tp == 2 else {}
        return lambda: VllmLLM(model, config, tmp / f"vllm-tp{tp}.log", env=env,
                               llm={"tensor_parallel_size": tp}, **events)
    llms = dict(zip((2, 1), start_together(starter(2), starter(1))))
    yield llms
    close_together(*llms.values())


def events_endpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The TP=2 vLLM's KV event publisher (it binds it: local, no network)."""
    return f"ipc://{tmp_path_factory.getbasetemp()}/tp-events.sock"


def stored_values(redis: RedisServer, minimum: int, timeout: float = 60.0) -> int:
    """Waits (bounded) until Redis holds at least `minimum` chunk values (one per chunk and KV
    head: the key families index aside); returns how many it holds."""
    wait_until(lambda: len(redis.client().keys("kvtier:*@H*")) >= minimum, timeout, 0.2)
    return len(redis.client().keys("kvtier:*@H*"))


def assert_same(cold: dict[str, Any], warm: dict[str, Any]) -> None:
    assert warm["tokens"] == cold["tokens"]
    for c, w in zip(cold["logprobs"], warm["logprobs"], strict=True):
        assert c.keys() == w.keys()
        assert max(abs(c[t] - w[t]) for t in c) <= 1e-3


def test_tensor_parallel_loads_each_ranks_heads_and_crosses_tp_sizes(
        tp_llms: dict[int, VllmLLM], redis_server_session: RedisServer) -> None:
    tp2, tp1 = tp_llms[2], tp_llms[1]
    rng = random.Random(1)
    first, second = (rng.choices(range(3, 1000), k=PROMPT) for _ in range(2))
    chunks = -(-PROMPT // CHUNK)
    redis_server_session.client().flushall()

    # TP=2 stores (each rank its head), reloads from its ranks' cpu tiers; TP=1 loads it from Redis
    tp1_cold = tp1.generate([first], logprobs=5, kv_transfer_params=SKIP_SAVE)["outputs"][0]
    cold = tp2.generate([first], logprobs=5)["outputs"][0]
    warm = tp2.generate([first], logprobs=5)
    assert cold["cached"] == 0 and tp1_cold["cached"] == 0
    assert warm["outputs"][0]["cached"] >= 0.9 * PROMPT, tp2.tail()
    assert_same(cold, warm["outputs"][0])
    assert warm["metrics"]["vllm:kv_cache_usage_perc"] == 0
    assert stored_values(redis_server_session, chunks * HEADS) == chunks * HEADS  # one value per chunk and head
    crossed = tp1.generate([first], logprobs=5)["outputs"][0]
    assert crossed["cached"] >= 0.9 * PROMPT, tp1.tail()
    assert_same(tp1_cold, crossed)

    # and the reverse: TP=1 stores, TP=2 (nothing of it in its cpu tiers) loads from Redis
    tp2_cold = tp2.generate([second], logprobs=5, kv_transfer_params=SKIP_SAVE)["outputs"][0]
    tp1.generate([second], logprobs=5)
    assert stored_values(redis_server_session, 2 * chunks * HEADS) == 2 * chunks * HEADS
    crossed = tp2.generate([second], logprobs=5)
    assert crossed["outputs"][0]["cached"] >= 0.9 * PROMPT, tp2.tail()
    assert_same(tp2_cold, crossed["outputs"][0])
    assert crossed["metrics"]["vllm:kv_cache_usage_perc"] == 0
    text = tp2.log.read_text(errors="replace")
    assert "KV heads (0, 2) of rank 0" in text and "KV heads (2, 4) of rank 1" in text, tp2.tail()


def test_a_rank_whose_load_fails_reports_it_and_vllm_recomputes(
        tp_llms: dict[int, VllmLLM], redis_server_session: RedisServer) -> None:
    """TP=1 stores a prompt; every value of rank 1's KV heads (2 and 3 at TP=2) is then
    corrupted in Redis. At TP=2, rank 0 loads its heads and rank 1's load fails: rank 1
    reports its blocks, and vLLM (policy "recompute") recomputes them. The blocks are
    scrubbed first (`scrub` in test_faults.py), so a failure left unreported would show as
    other logprobs."""
    tp2, tp1 = tp_llms[2], tp_llms[1]
    client = redis_server_session.client()
    prompt = random.Random(2).choices(range(3, 1000), k=PROMPT)
    chunks = -(-PROMPT // CHUNK)
    cold_run = tp2.generate([prompt], logprobs=5, kv_transfer_params=SKIP_SAVE)
    cold = cold_run["outputs"][0]
    before = set(client.keys("kvtier:*"))
    tp1.generate([prompt])
    wait_until(lambda: len(set(client.keys("kvtier:*")) - before) >= chunks * HEADS, 60.0, 0.2)
    rank1 = [k for k in set(client.keys("kvtier:*")) - before if k.endswith((b"@H2", b"@H3"))]
    assert len(rank1) == 2 * chunks
    for key in rank1:
        value = client.get(key)
        assert value is not None
        mid = len(value) // 2
        client.setrange(key, mid, bytes([value[mid] ^ 0xFF]))
    tp2.generate([prompt[::-1]], max_tokens=1, kv_transfer_params=SKIP_SAVE)  # other K/V in the blocks
    warm = tp2.generate([prompt], logprobs=5)
    hits = "vllm:external_prefix_cache_hits"
    promised = warm["metrics"][hits] - cold_run["metrics"][hits]
    assert promised >= 0.9 * PROMPT  # every chunk was found, and its load began on both ranks
    assert_same(cold, warm["outputs"][0])
    assert warm["metrics"]["vllm:kv_cache_usage_perc"] == 0


def test_kv_events_are_published_once_per_chunk_and_tier_with_two_ranks(
        tp_llms: dict[int, VllmLLM], tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each rank stores its own heads of every chunk; the events are the chunks': one
    `BlockStored` per chunk and tier, not one per rank or per head."""
    tp2 = tp_llms[2]
    prompt = random.Random(3).choices(range(3, 1000), k=PROMPT)
    chunks = [prompt[i:i + CHUNK] for i in range(0, PROMPT - PROMPT % CHUNK, CHUNK)]  # the whole ones
    # asks for twice the expected number, so duplicates would arrive; waits 6 s for them
    events = collect_kv_events(tp2, events_endpoint(tmp_path_factory), lambda: tp2.generate([prompt]),
                               want=4 * len(chunks), timeout=6.0)
    mine = [e for e in events if isinstance(e, BlockStored) and e.token_ids in chunks]
    media = {e.medium for e in mine}
    assert len(media) == 2, events  # the cpu tier and Redis
    for medium in media:
        announced = [e for e in mine if e.medium == medium]
        assert [e.token_ids for e in announced] == chunks, (medium, announced)
        assert len({e.block_hashes[0] for e in announced}) == len(chunks)
