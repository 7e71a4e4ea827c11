"""Asynchronous loads: a request whose prefix a tier holds is parked while a background loader
fills its blocks, the running batch keeps stepping, and whatever happens to the chunks
between the lookup (existence) and the fetch, the tokens are those of a cold run."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest

from connector.engine_connector import build_connector
from engine import SamplingParams
from engine.sequence import SequenceStatus
from kvstore.backends.memory import CPUBackend
from kvstore.storage_manager import StorageManager
from tests.fixtures.connector import CHUNK, GREEDY, assert_idle, engine, run

pytestmark = pytest.mark.slow


class _SlowReadTier(CPUBackend):
    """A real CPU tier whose chunk reads wait for a gate (existence queries do not): a slow
    tier, deterministically. `reading` is set while a read waits."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.reading = threading.Event()

    def _wait(self) -> None:
        if not self.gate.is_set():
            self.reading.set()
            assert self.gate.wait(60), "test gate never opened"

    def batched_get(self, keys, *, read_only=False):
        self._wait()
        return super().batched_get(keys, read_only=read_only)


def hold_loader(conn) -> threading.Event:
    """Queues a job ahead of every later load on the connector's (FIFO, one-thread) loader;
    loads wait until the returned event is set: the gap between lookup and fetch."""
    release = threading.Event()
    conn.worker.loader.jobs.submit(lambda: release.wait(60))
    return release


def step_until_done(llm, limit: int = 2000) -> dict[str, object]:
    """Steps the engine until nothing is unfinished; returns the last output per request."""
    last = {}
    for _ in range(limit):
        if not llm.engine.has_unfinished_requests():
            return last
        for o in llm.engine.step():
            last[o.request_id] = o
    raise AssertionError("engine did not finish")


@contextmanager
def warm_engine(default_model_path, prompt_ids, tier_url_or_storage, **kw):
    """Yields (connector, engine) after one cold run of `prompt_ids` was stored."""
    storage = tier_url_or_storage if isinstance(tier_url_or_storage, StorageManager) else None
    urls = None if storage is not None else [tier_url_or_storage]
    conn = build_connector(urls, storage=storage, chunk_size=CHUNK)
    with engine(default_model_path, conn, enable_prefix_caching=False, **kw) as llm:
        run(llm, prompt_ids)
        assert conn.flush(timeout=60)
        yield conn, llm


def test_a_warm_request_is_parked_while_its_load_runs(default_model_path, prompt_ids, reference):
    with warm_engine(default_model_path, prompt_ids, "cpu") as (conn, llm):
        release = hold_loader(conn)
        rid = llm.engine.add_request({"prompt_token_ids": prompt_ids}, GREEDY)
        for _ in range(3):  # nothing can run: step() waits briefly for the load, never raises
            assert llm.engine.step() == []
            assert llm.engine.is_waiting_for_kv() and llm.engine.has_unfinished_requests()
        (seq, start, n) = llm.engine.scheduler.waiting_for_kv[rid]
        assert seq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS and (start, n) == (0, len(prompt_ids) - 1)
        release.set()
        out = step_until_done(llm)[rid]
        assert out.outputs[0].token_ids == reference and out.num_cached_tokens == len(prompt_ids) - 1
        assert llm.get_stats()["connector_load_error_tokens"] == 0
        assert_idle(llm, conn)


@pytest.mark.parametrize("fault", ["deleted", "corrupted", "killed"])
def test_chunks_lost_between_lookup_and_fetch_are_recomputed(fault, default_model_path, prompt_ids, reference,
                                                             redis_server):
    with warm_engine(default_model_path, prompt_ids, redis_server.url) as (conn, llm):
        keys = [sp.key for sp in conn.planner.keyspace.spans(prompt_ids)]
        client = redis_server.client()
        release = hold_loader(conn)
        rid = llm.engine.add_request({"prompt_token_ids": prompt_ids}, GREEDY)
        assert llm.engine.step() == [] and rid in llm.engine.scheduler.waiting_for_kv  # looked up
        if fault == "deleted":  # evicted by Redis after the lookup said it was there
            client.delete(keys[1])
            first_bad = CHUNK
        elif fault == "corrupted":
            value = bytearray(client.get(keys[2]))
            value[len(value) // 2] ^= 0xFF
            client.set(keys[2], bytes(value))
            first_bad = 2 * CHUNK
        else:
            redis_server.kill()
            first_bad = 0
        release.set()
        out = step_until_done(llm)[rid]
        assert out.outputs[0].token_ids == reference
        assert out.num_cached_tokens == first_bad  # CHUNK is a multiple of the block size
        lost = len(prompt_ids) - 1 - first_bad
        assert llm.get_stats()["connector_load_error_tokens"] == lost
        assert conn.request_metrics(rid).load_error_tokens == lost
        if fault == "killed":
            redis_server.restart()
        assert_idle(llm, conn)


@pytest.mark.parametrize("when", ["queued", "reading"])
def test_abort_while_the_load_is_in_flight_leaks_nothing(when, default_model_path, prompt_ids, reference):
    tier = _SlowReadTier()
    with warm_engine(default_model_path, prompt_ids, StorageManager([tier])) as (conn, llm):
        engine = llm.engine
        release = hold_loader(conn) if when == "queued" else None
        tier.gate.clear()
        rid = engine.add_request({"prompt_token_ids": prompt_ids}, GREEDY)
        engine.step()
        seq = engine.scheduler.waiting_for_kv[rid][0]
        blocks = list(seq.block_table)
        if when == "reading":
            assert tier.reading.wait(60)  # the loader is inside the tier's read, chunks pinned
            assert conn.storage.holds.total() > 0
        engine.abort_request(rid)
        # Finished, but its blocks stay with it until the loader let go of them.
        assert seq.status is SequenceStatus.FINISHED_ABORTED and rid in engine.scheduler.delayed_free
        assert all(engine.block_manager.pool.blocks[b].ref_cnt == 1 for b in blocks)
        assert engine.has_unfinished_requests()
        if release is not None:
            release.set()
        tier.gate.set()
        step_until_done(llm)
        assert not engine.scheduler.delayed_free
        assert_idle(llm, conn)  # every ref count and pin back to 0
        # The engine is intact: the same prompt still gives the cold tokens.
        assert run(llm, prompt_ids).outputs[0].token_ids == reference


def test_the_running_batch_keeps_stepping_while_a_slow_tier_is_read(default_model_path, prompt_ids, reference):
    tier = _SlowReadTier()
    with warm_engine(default_model_path, prompt_ids, StorageManager([tier])) as (conn, llm):
        engine = llm.engine
        other = prompt_ids[::-1][:100]  # a different prompt: computed, not loaded
        busy = engine.add_request({"prompt_token_ids": other}, SamplingParams(temperature=0.0, max_tokens=40))
        engine.step()  # its prefill
        tier.gate.clear()
        warm = engine.add_request({"prompt_token_ids": prompt_ids}, GREEDY)
        got = [o.request_id for o in engine.step()]  # admits the warm request: its load starts
        assert tier.reading.wait(60)  # the loader is stuck inside the tier's read from now on
        for _ in range(10):
            got += [o.request_id for o in engine.step()]
            assert warm in engine.scheduler.waiting_for_kv and not tier.gate.is_set()
        assert got == [busy] * 11  # meanwhile one token per step for the running request
        tier.gate.set()
        last = step_until_done(llm)
        assert last[warm].outputs[0].token_ids == reference
        assert last[warm].num_cached_tokens == len(prompt_ids) - 1
        assert_idle(llm, conn)


def test_many_concurrent_warm_requests(default_model_path, prompt_ids, reference):
    with warm_engine(default_model_path, prompt_ids, "cpu", num_gpu_blocks=512) as (conn, llm):
        # Same prefix, some grown by a few tokens: every one is loaded in the background at once.
        prompts = [prompt_ids] * 4 + [prompt_ids + prompt_ids[:k] for k in (3, 17, 40, 64)]
        with engine(default_model_path, None, enable_prefix_caching=False, num_gpu_blocks=512) as cold:
            want = [o.outputs[0].token_ids for o in cold.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
        assert want[0] == reference
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert all(o.num_cached_tokens >= len(prompt_ids) - 1 - CHUNK for o in outs)
        assert llm.get_stats()["connector_load_error_tokens"] == 0
        assert_idle(llm, conn)
