"""End to end on the default model: reused prefixes give exactly the tokens a full prefill
gives, on every tier, across processes, and never across models; failures mean recompute."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from connector.connector_config import make_config
from connector.engine_connector import EngineConnector, build_connector
from engine import LLM, SamplingParams
from harness import process
from harness.model import make_tiny_checkpoint
from kvstore.storage_manager import StorageManager
from tests.fixtures.connector import CHUNK, assert_idle, engine, run, tier_url

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tier", ["device", "cpu", "disk", "redis", "kvtier"])
def test_reuse_gives_identical_tokens_on_each_tier(tier, default_model_path, prompt_ids, reference,
                                                   tmp_path, request):
    conn = build_connector([tier_url(tier, tmp_path, request)], chunk_size=CHUNK)
    # Engine prefix cache off: every reused token comes through the connector. A small batch
    # budget spreads the cold prefill over several steps (chunks complete mid-prefill).
    with engine(default_model_path, conn, enable_prefix_caching=False, max_num_batched_tokens=64) as llm:
        cold = run(llm, prompt_ids)
        assert cold.outputs[0].token_ids == reference
        assert cold.num_cached_tokens == 0
        assert conn.flush(timeout=60)
        warm = run(llm, prompt_ids)
        assert warm.outputs[0].token_ids == reference
        # Full chunks plus the stored partial last chunk: all but the last prompt token.
        assert warm.num_cached_tokens == len(prompt_ids) - 1
        m = conn.request_metrics(warm.request_id)
        assert m.connector_hit_tokens == len(prompt_ids) - 1 and m.bytes_loaded > 0
        assert m.stored_tokens == 0  # everything was already stored
        tiers = conn.tier_metrics()
        # the prompt tokens loaded from the tier, as connector_hit_tokens counts them (and vllm serve)
        assert tiers[0].tokens_hit == len(prompt_ids) - 1 and tiers[0].bytes_stored > 0
        assert_idle(llm, conn)


def test_llm_builds_its_connector_from_a_config(default_model_path, prompt_ids, reference, tmp_path):
    """`LLM(kv_connector=<config>)`: the engine finds the factory by entry point, not by import."""
    cfg = {"chunk_size": CHUNK, "tiers": ["cpu", f"disk://{tmp_path / 'kv'}"]}
    with engine(default_model_path, cfg, enable_prefix_caching=False) as llm:
        conn = llm.engine.kv_connector
        assert isinstance(conn, EngineConnector) and conn.config.chunk_size == CHUNK
        assert run(llm, prompt_ids).outputs[0].token_ids == reference
        warm = run(llm, prompt_ids)
        assert warm.outputs[0].token_ids == reference and warm.num_cached_tokens == len(prompt_ids) - 1
        assert_idle(llm, conn)


def test_bad_connector_config_names_the_key_and_leaks_nothing(default_model_path, tmp_path):
    import threading

    before = set(threading.enumerate())
    with pytest.raises(ValueError, match="chunk_sise"):
        LLM(str(default_model_path), kv_connector={"chunk_sise": 64, "tiers": ["cpu"]})
    with pytest.raises(ValueError, match="does-not-exist"):  # the engine fails after the connector is built
        LLM(str(tmp_path / "does-not-exist"), kv_connector=["cpu", f"disk://{tmp_path / 'kv'}"])
    assert {t for t in threading.enumerate() if t.is_alive()} <= before  # its writer threads were stopped


def test_connector_restores_what_the_engine_prefix_cache_evicted(default_model_path, prompt_ids, reference):
    conn = build_connector(["cpu"], chunk_size=CHUNK)
    with engine(default_model_path, conn, enable_prefix_caching=True) as llm:
        assert run(llm, prompt_ids).outputs[0].token_ids == reference
        # Engine prefix cache still warm: it serves whole blocks, the connector only the rest.
        again = run(llm, prompt_ids)
        m = conn.request_metrics(again.request_id)
        assert m.engine_hit_tokens == (len(prompt_ids) - 1) // 16 * 16
        assert m.connector_hit_tokens == len(prompt_ids) - 1 - m.engine_hit_tokens
        assert again.num_cached_tokens == len(prompt_ids) - 1
        assert again.outputs[0].token_ids == reference
        # Engine prefix cache dropped: the connector restores the whole prefix.
        assert conn.flush(timeout=60)
        assert llm.reset_prefix_cache()
        restored = run(llm, prompt_ids)
        assert restored.num_cached_tokens == len(prompt_ids) - 1
        assert conn.request_metrics(restored.request_id).engine_hit_tokens == 0
        assert restored.outputs[0].token_ids == reference
        assert_idle(llm, conn)


def test_prefix_shared_by_different_suffixes(default_model_path, prompt_ids):
    """Only the common chunks are reused; the divergent suffix is computed."""
    other = prompt_ids[:100] + prompt_ids[:20]
    with engine(default_model_path, None, enable_prefix_caching=False) as plain:
        want = run(plain, other).outputs[0].token_ids
    conn = build_connector(["cpu"], chunk_size=CHUNK)
    with engine(default_model_path, conn, enable_prefix_caching=False) as llm:
        run(llm, prompt_ids)
        assert conn.flush(timeout=60)
        out = run(llm, other)
        assert out.num_cached_tokens == 96  # two whole chunks are a common prefix
        assert out.outputs[0].token_ids == want
        assert_idle(llm, conn)


@pytest.mark.parametrize("tier", ["cpu", "disk", "redis", "kvtier"])
def test_a_grown_prompt_finds_the_partial_chunk_its_shorter_version_stored(tier, default_model_path, prompt_ids,
                                                                           tmp_path, request):
    """A chat's next round: the chunk that was partial has grown, so its full key misses, and
    the partial tail stored last time is found through its own key instead of recomputed."""
    short, grown = prompt_ids[:100], prompt_ids[:130]  # [96, 100) stored partial; [96, 130) now
    with engine(default_model_path, None, enable_prefix_caching=False) as plain:
        want = run(plain, grown).outputs[0].token_ids
    conn = build_connector([tier_url(tier, tmp_path, request)], chunk_size=CHUNK)
    with engine(default_model_path, conn, enable_prefix_caching=False) as llm:
        run(llm, short)
        assert conn.flush(timeout=60)
        out = run(llm, grown)
        assert out.num_cached_tokens == 100  # two whole chunks and the 4-token partial one
        assert out.outputs[0].token_ids == want
        assert_idle(llm, conn)


def test_decode_tokens_are_saved_when_enabled(default_model_path, prompt_ids):
    conn = build_connector(["cpu"], chunk_size=CHUNK, save_decode_tokens=True)
    with engine(default_model_path, conn, enable_prefix_caching=False) as llm:
        first = llm.generate([{"prompt_token_ids": prompt_ids}],
                             SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True))[0]
        history = prompt_ids + first.outputs[0].token_ids
        assert conn.flush(timeout=60)
        follow = run(llm, history + prompt_ids[:8])
        # The whole history had K/V except its last generated token (never computed): whole
        # chunks, then the partial tail saved when the first request finished.
        assert follow.num_cached_tokens == len(history) - 1
        assert follow.num_cached_tokens > len(prompt_ids)
        assert_idle(llm, conn)


def test_different_models_never_share_kv(default_model_path, prompt_ids, tmp_path):
    shared = StorageManager.from_config(make_config(["cpu"]).kvstore)
    tiny_a = make_tiny_checkpoint(tmp_path, "llama", seed=0, tokenizer_dir=default_model_path)
    tiny_b = make_tiny_checkpoint(tmp_path, "llama", seed=1, tokenizer_dir=default_model_path)
    results = []
    for model in (default_model_path, tiny_a, tiny_b):
        conn = build_connector(["cpu"], chunk_size=CHUNK, storage=shared)
        with engine(model, conn, enable_prefix_caching=False) as llm:
            first = run(llm, prompt_ids)
            assert conn.flush(timeout=60)
            second = run(llm, prompt_ids)
            results.append((first.num_cached_tokens, second.num_cached_tokens))
    # Each model misses on the others' chunks and hits only its own.
    assert results == [(0, len(prompt_ids) - 1)] * 3
    n_chunks = -(-len(prompt_ids) // CHUNK)
    assert sum(s.backend.entries for s in shared.stats().values()) == 3 * n_chunks
    shared.close()


def test_corrupted_chunk_in_redis_is_recomputed(default_model_path, prompt_ids, reference, redis_server):
    conn = build_connector([redis_server.url], chunk_size=CHUNK)
    with engine(default_model_path, conn, enable_prefix_caching=False) as llm:
        run(llm, prompt_ids)
        assert conn.flush(timeout=60)
        keys = [sp.key for sp in conn.planner.keyspace.spans(prompt_ids)]
        client = redis_server.client()
        assert all(client.exists(k) for k in keys)
        value = bytearray(client.get(keys[2]))
        value[len(value) // 2] ^= 0xFF  # one flipped payload byte
        client.set(keys[2], bytes(value))
        out = run(llm, prompt_ids)
        assert out.num_cached_tokens == 2 * CHUNK  # chunks before the corrupt one
        assert out.outputs[0].token_ids == reference
        assert_idle(llm, conn)
        assert conn.flush(timeout=60)
        assert client.exists(keys[2])  # recomputed and stored again


def test_redis_killed_mid_workload_means_recompute(default_model_path, prompt_ids, reference, redis_server):
    conn = build_connector([redis_server.url], chunk_size=CHUNK)
    with engine(default_model_path, conn, enable_prefix_caching=False) as llm:
        run(llm, prompt_ids)
        assert conn.flush(timeout=60)
        redis_server.kill()
        down = run(llm, prompt_ids)  # lookup and store both fail: computed, no error
        assert down.outputs[0].token_ids == reference
        assert down.num_cached_tokens == 0
        assert conn.tier_metrics()[0].errors >= 1  # seen, counted, not raised
        redis_server.restart()
        assert_idle(llm, conn)
    # Leaving the block shut the engine down: flushing against a tier that failed did not raise.


_CHILD = r"""
import json, sys
from connector.engine_connector import build_connector
from engine import LLM, SamplingParams
conn = build_connector(json.loads(sys.argv[1]), chunk_size=int(sys.argv[2]))
llm = LLM(sys.argv[3], device="cpu", dtype="float32", block_size=16, num_gpu_blocks=64,
          enable_prefix_caching=False, kv_connector=conn)
ids = json.loads(sys.argv[4])
out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=6))[0]
llm.shutdown()  # flushes the stores to the shared tiers before exit
print(json.dumps({"cached": out.num_cached_tokens, "tokens": out.outputs[0].token_ids}))
"""


def test_a_second_process_reuses_prefix_through_each_shared_tier(default_model_path, prompt_ids, reference,
                                                                 redis_server, cache_server):
    """Engine processes (different PYTHONHASHSEED each) share a prefix through Redis and through
    the cache server: one process stores it in both, then one process per tier, reading that
    tier alone, reuses all but the last token."""

    def child(seed: str, urls: list[str]) -> dict:
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        proc = process.run([sys.executable, "-c", _CHILD, json.dumps(urls), str(CHUNK),
                            str(default_model_path), json.dumps(prompt_ids)],
                           capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    assert child("1", [redis_server.url, cache_server.url]) == {"cached": 0, "tokens": reference}
    for seed, url in (("2", redis_server.url), ("3", cache_server.url)):
        assert child(seed, [url]) == {"cached": len(prompt_ids) - 1, "tokens": reference}, url
