"""lm-eval-harness, a client nobody here wrote, against a real `kvtier serve`: its
`local-completions` model on a multiple-choice task (loglikelihoods: echo + logprobs) and a
generate_until task (greedy), both on local data (harness/lm_eval_tasks). The scores
and every document's responses are the same with the cache cold, warm from the engine's
prefix cache, warm from the `cpu` tier and warm from Redis; the warm runs are checked to have
reused every generate_until prompt but its last token, so the comparison means something.

Scoring requests (prompt logprobs) read no cache, as in vLLM: they compute every position in
every configuration. The generate_until prompts are what the caches serve."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.lm_eval_tasks.configurations import run_configurations
from harness.redis import RedisServer
from harness.serve import ENGINE_ARGS, NAME

pytestmark = pytest.mark.slow
# Each task's first 6 documents (of 20: harness/lm_eval_tasks/data): one generate_until
# batch of 6 prompts, 24 scored continuations; the benchmark evaluates all 20.
DOCS_PER_TASK = 6


def test_scores_identical_cold_and_warm(default_model_path: Path, redis_server: RedisServer) -> None:
    runs = run_configurations(default_model_path, NAME, redis_server.url, ENGINE_ARGS, limit=DOCS_PER_TASK)
    cold, engine, cpu, redis = (runs[c].moved for c in ("cold", "engine", "cpu", "redis"))

    queried = cold["kvtier:prefix_cache_queries_total"]
    assert queried > 50 * DOCS_PER_TASK  # the generate_until prompts; scoring requests look nothing up
    # cold: nothing loaded, only the shared instruction found again within the run
    assert cold["kvtier:kv_connector_hit_tokens_total"] == 0
    assert cold["kvtier:prefix_cache_hits_total"] < queried - 10 * DOCS_PER_TASK
    for name, moved in (("engine", engine), ("cpu", cpu), ("redis", redis)):
        assert moved["kvtier:prefix_cache_queries_total"] == queried, name
        reused = moved["kvtier:prefix_cache_hits_total"] + moved["kvtier:kv_connector_hit_tokens_total"]
        assert reused == queried - DOCS_PER_TASK, (name, moved)  # all but each prompt's last token
    assert engine["kvtier:prefix_cache_hits_total"] > 0.8 * queried
    assert cpu["loaded[cpu]"] > 0 and cpu["loaded[redis]"] == 0  # the fastest tier holding a chunk serves it
    assert cpu["kvtier:kv_connector_hit_tokens_total"] > queried / 3
    assert redis["loaded[redis]"] > 0
    assert redis["kvtier:kv_connector_hit_tokens_total"] > queried / 3

    want = runs["cold"].run
    assert [len(want.samples[t]) for t in ("kvtier_mc", "kvtier_gen")] == [DOCS_PER_TASK, DOCS_PER_TASK]
    assert want.scores["kvtier_mc"]["acc"] > 0.25 and want.scores["kvtier_gen"]["exact_match"] > 0.25  # not noise
    for name, config in runs.items():
        got = config.run
        assert got.scores == want.scores, name
        assert got.samples["kvtier_gen"] == want.samples["kvtier_gen"], name
        for g, w in zip(got.samples["kvtier_mc"], want.samples["kvtier_mc"], strict=True):
            assert [is_greedy for _, is_greedy in g["filtered_resps"]] == [b for _, b in w["filtered_resps"]]
            assert [ll for ll, _ in g["filtered_resps"]] == pytest.approx([ll for ll, _ in w["filtered_resps"]],
                                                                          abs=1e-5), (name, g["doc_id"])
