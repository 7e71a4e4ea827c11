"""Layer-pipelined loads (`use_layerwise`): a warm request runs in the step that admits it, its
forward's layer i waiting only for layer i; the K/V it ends up with is bit for bit what a
whole-chunk load gives, and a layer that does not arrive is a miss recomputed exactly."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from connector.engine_connector import build_connector
from engine import SamplingParams
from engine.kv_cache import layout_for
from kvkeys.keyspace import layer_key
from kvstore.backends.memory import CPUBackend
from kvstore.storage_manager import StorageManager
from tests.fixtures.connector import CHUNK, assert_idle, engine, run, tier_url

pytestmark = pytest.mark.slow
TWO = SamplingParams(temperature=0.0, max_tokens=2)


def warm_cache(llm, ids: list[int]) -> tuple[torch.Tensor, int]:
    """Runs `ids` until its prefill is done; returns (the K/V of its prompt positions gathered
    from the engine's cache, its cached tokens), then lets it finish."""
    eng = llm.engine
    rid = eng.add_request({"prompt_token_ids": ids}, TWO)
    for _ in range(100):
        outs = [o for o in eng.step() if o.request_id == rid]
        if outs:
            seq = next(s for s in eng.scheduler.running if s.request_id == rid)
            layout = layout_for(eng.runner.kv_caches)
            kv = layout.gather_chunk(layout.slots(seq.block_table, 0, len(ids))).clone()
            while eng.has_unfinished_requests():
                eng.step()
            return kv, outs[0].num_cached_tokens
    raise AssertionError("no first token")


@pytest.fixture(scope="module")
def whole_chunk_cache(default_model_path: Path, prompt_ids: list[int]) -> torch.Tensor:
    """The prompt's K/V after a warm whole-chunk (asynchronous) load from a cpu tier."""
    conn = build_connector(["cpu"], chunk_size=CHUNK)
    with engine(default_model_path, conn, enable_prefix_caching=False) as llm:
        run(llm, prompt_ids)
        assert conn.flush(timeout=60)
        kv, cached = warm_cache(llm, prompt_ids)
    assert cached == len(prompt_ids) - 1
    return kv


@contextmanager
def layerwise_engine(default_model_path, prompt_ids, tiers, storage=None, **kw):
    """Yields (connector, engine) with `use_layerwise` after a cold run stored `prompt_ids`."""
    conn = build_connector(tiers, storage=storage, chunk_size=CHUNK, use_layerwise=True)
    with engine(default_model_path, conn, enable_prefix_caching=False, **kw) as llm:
        run(llm, prompt_ids)  # cold: stores one value per layer and chunk
        assert conn.flush(timeout=60)
        yield conn, llm


@pytest.mark.parametrize("tier", ["cpu", "disk", "redis", "kvtier"])
def test_layerwise_cache_is_bit_identical_to_whole_chunk_loads(tier, default_model_path, prompt_ids, reference,
                                                               whole_chunk_cache, tmp_path, request):
    with layerwise_engine(default_model_path, prompt_ids, [tier_url(tier, tmp_path, request)]) as (conn, llm):
        n = len(prompt_ids)
        spans = conn.planner.keyspace.spans(prompt_ids)
        assert conn.storage.batched_contains([layer_key(spans[0].key, llm.model_config.num_layers - 1)])[0]
        assert list(conn.lookup(prompt_ids).values()) == [n - 1]  # /kv/lookup counts layered chunks
        kv, cached = warm_cache(llm, prompt_ids)
        assert cached == n - 1
        assert torch.equal(kv, whole_chunk_cache)  # every layer, every position, bit for bit
        warm = run(llm, prompt_ids)
        assert warm.outputs[0].token_ids == reference and warm.num_cached_tokens == n - 1
        # Scheduled at once: never parked waiting for its K/V.
        assert conn.request_metrics(warm.request_id).connector_hit_tokens == n - 1
        assert llm.get_stats()["connector_load_error_tokens"] == 0
        assert_idle(llm, conn)


@pytest.mark.parametrize("where", ["first_layer", "middle_layer", "last_layer"])
def test_a_corrupted_layer_is_a_miss_recomputed_exactly(where, default_model_path, prompt_ids, reference,
                                                        redis_server):
    with layerwise_engine(default_model_path, prompt_ids, [redis_server.url]) as (conn, llm):
        layers = llm.model_config.num_layers
        layer = {"first_layer": 0, "middle_layer": layers // 2, "last_layer": layers - 1}[where]
        key = layer_key(conn.planner.keyspace.spans(prompt_ids)[2].key, layer)
        client = redis_server.client()
        value = bytearray(client.get(key))
        value[-10] ^= 0xFF  # the payload: only its checksum can tell
        client.set(key, bytes(value))
        out = run(llm, prompt_ids)
        assert out.outputs[0].token_ids == reference
        assert out.num_cached_tokens == 2 * CHUNK  # up to the corrupted chunk; the rest recomputed
        lost = len(prompt_ids) - 1 - 2 * CHUNK
        assert llm.get_stats()["connector_load_error_tokens"] == lost
        assert conn.request_metrics(out.request_id).load_error_tokens == lost
        assert conn.flush(timeout=60)
        # The failed step stored nothing computed over the bad layer; the recompute stored it right.
        again = run(llm, prompt_ids)
        assert again.outputs[0].token_ids == reference and again.num_cached_tokens == len(prompt_ids) - 1
        assert_idle(llm, conn)


class _GatedTier(CPUBackend):
    """A real CPU tier whose reads of keys ending in `gated` wait for a gate."""

    def __init__(self, gated: str) -> None:
        super().__init__()
        self.gated = gated
        self.gate = threading.Event()
        self.gate.set()

    def batched_get(self, keys, *, read_only=False):
        if any(k.endswith(self.gated) for k in keys):
            assert self.gate.wait(60), "test gate never opened"
        return super().batched_get(keys, read_only=read_only)


def test_layer_zero_computes_while_the_last_layer_is_still_being_read(default_model_path, prompt_ids, reference):
    layers = 30  # the default model's
    tier = _GatedTier(f"@L{layers - 1}")
    with layerwise_engine(default_model_path, prompt_ids, None, storage=StorageManager([tier])) as (conn, llm):
        assert llm.model_config.num_layers == layers
        first_layer_ran = threading.Event()
        hook = llm.engine.runner.model.model.layers[0].register_forward_hook(lambda *_: first_layer_ran.set())
        tier.gate.clear()
        result: dict[str, object] = {}
        t = threading.Thread(target=lambda: result.update(out=run(llm, prompt_ids)))
        t.start()
        try:
            assert first_layer_ran.wait(60)  # layer 0 ran over its loaded K/V ...
            assert not tier.gate.is_set() and t.is_alive()  # ... while the last layer is not read yet
        finally:
            tier.gate.set()
            t.join(120)
            hook.remove()
        out = result["out"]
        assert out.outputs[0].token_ids == reference and out.num_cached_tokens == len(prompt_ids) - 1
        assert_idle(llm, conn)
