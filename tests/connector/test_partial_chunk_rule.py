"""The partial-chunk rule (LMCache issue #2206): a load never writes blocks the engine's prefix
cache owns, even when the stored chunk starts before the engine's hit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from connector.engine_connector import build_connector
from engine import LLM, SamplingParams
from engine.kv_cache import layout_for
from harness.model import make_tiny_checkpoint


def test_load_straddling_the_engine_hit_is_sliced(tmp_path: Path, default_model_path: Path):
    model = make_tiny_checkpoint(tmp_path, "llama", seed=0, tokenizer_dir=default_model_path)
    conn = build_connector(["cpu"], chunk_size=48)
    with LLM(str(model), device="cpu", dtype="float32", block_size=16, num_gpu_blocks=32,
             enable_prefix_caching=True, kv_connector=conn) as llm:
        ids = [(i * 7919 + 13) % 40000 + 100 for i in range(118)]  # chunks [0,48) [48,96) [96,118)
        params = SamplingParams(temperature=0.0, max_tokens=1)
        llm.generate([{"prompt_token_ids": ids}], params)
        assert conn.flush(timeout=60)

        # Poison the stored partial chunk: wherever it lands, it shows.
        key = conn.planner.keyspace.spans(ids)[2].key
        tier = conn.storage.tiers[0]
        poisoned = tier.get(key) + 1000.0
        tier.put(key, poisoned)
        pool = llm.engine.block_manager.pool
        cached_ids = torch.tensor(sorted(b.block_id for b in pool.cached.values()))
        assert len(cached_ids) == 7  # positions [0, 112) held by the engine's prefix cache
        before = [kv[:, cached_ids].clone() for kv in llm.engine.runner.kv_caches]

        jobs = []  # observe the loads the scheduler side hands the worker side
        bind = conn.worker.bind_connector_metadata
        conn.worker.bind_connector_metadata = lambda meta: (jobs.extend(meta.loads), bind(meta))
        out = llm.generate([{"prompt_token_ids": ids}], params)[0]
        m = conn.request_metrics(out.request_id)
        assert (m.engine_hit_tokens, m.connector_hit_tokens) == (112, 5)  # [112, 117) from [96, 118)
        for kv, old in zip(llm.engine.runner.kv_caches, before):
            assert torch.equal(kv[:, cached_ids], old)  # the engine's blocks were not rewritten
        # ...while the slice past the hit really was loaded, into the request's fresh block.
        assert len(jobs) == 1 and (jobs[0].start, jobs[0].end) == (112, 117)
        layout = layout_for(llm.engine.runner.kv_caches)
        slots = layout.group_slots(jobs[0].block_ids, 112, 117)
        assert not set((slots // 16).tolist()) & set(cached_ids.tolist())
        got = layout.gather_chunk(slots)
        assert torch.equal(got, poisoned[:, :, 112 - 96:117 - 96])


def test_a_connector_serves_one_engine(tmp_path: Path, default_model_path: Path):
    model = make_tiny_checkpoint(tmp_path, "llama", seed=0, tokenizer_dir=default_model_path)
    conn = build_connector(["cpu"], chunk_size=48)
    with LLM(str(model), device="cpu", num_gpu_blocks=8, kv_connector=conn):
        with pytest.raises(ValueError, match="already serves an engine"):
            LLM(str(model), device="cpu", num_gpu_blocks=8, kv_connector=conn)
