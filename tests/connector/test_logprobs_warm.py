"""Reused K/V moves no probability: on the default model (fp32), the logprobs of a warm run
(its prompt loaded from the `cpu` tier or from Redis, or blended by CacheBlend at ratio 1.0
from stored segments) equal a cold run's to 1e-5, and a request asking for prompt logprobs
loads nothing (every prompt position is computed) and equals the cold run too.

The cold run computes the positions the warm run computes in a step of the same shape (the
prompt's last token alone, after a 64-token chunked prefill), so the only difference between
them is where the reused K/V came from. A step of another shape sums in another order: fp32
then differs by ~1e-5 whether or not anything was reused (tests/engine/test_logprobs.py bounds
that against transformers, 1e-4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from connector.blend.blend_api import blend_stats
from connector.engine_connector import build_connector
from engine import RequestOutput, SamplingParams
from engine.model_loader import load_tokenizer
from harness.text import PARAGRAPHS, long_text
from tests.fixtures.connector import CHUNK, assert_idle, engine, tier_url

pytestmark = pytest.mark.slow
K = 5
BUDGET = 64
SAMPLE = SamplingParams(temperature=0.0, max_tokens=6, logprobs=K)
SCORE = SamplingParams(temperature=0.0, max_tokens=6, logprobs=K, prompt_logprobs=K)


def values(out: RequestOutput, prompt: bool = True) -> torch.Tensor:
    """Every logprob of an output (prompt positions if `prompt`, then generated tokens)."""
    vals = [lp.logprob for pos in (out.prompt_logprobs or [])[1:] if prompt and pos for lp in pos.values()]
    vals += [lp.logprob for pos in out.outputs[0].logprobs or [] for lp in pos.values()]
    return torch.tensor(vals, dtype=torch.float64)


def max_diff(a: RequestOutput, b: RequestOutput, prompt: bool = True) -> float:
    """The largest logprob difference of two runs with the same tokens and top tokens."""
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert [list(p) for p in a.outputs[0].logprobs or []] == [list(p) for p in b.outputs[0].logprobs or []]
    x, y = values(a, prompt), values(b, prompt)
    assert x.shape == y.shape and x.numel() > 0
    return float((x - y).abs().max())


@pytest.fixture(scope="module")
def prompt(default_model_path: Path) -> dict:
    """129 tokens: a 64-token chunked prefill computes the last one alone, as a warm run does."""
    ids = load_tokenizer(default_model_path).encode(long_text(4))[: 2 * BUDGET + 1]
    assert len(ids) == 2 * BUDGET + 1 and len(ids) % CHUNK  # a partial last chunk is stored too
    return {"prompt_token_ids": ids}


@pytest.mark.parametrize("tier", ["cpu", "redis"])
def test_warm_logprobs_from_a_tier_equal_cold(tier: str, default_model_path: Path, prompt: dict,
                                              tmp_path: Path, request: pytest.FixtureRequest) -> None:
    n = len(prompt["prompt_token_ids"])
    conn = build_connector([tier_url(tier, tmp_path, request)], chunk_size=CHUNK)
    # No engine prefix cache: every reused token comes through the connector.
    with engine(default_model_path, conn, enable_prefix_caching=False, max_num_batched_tokens=BUDGET) as llm:
        cold = llm.generate(prompt, SCORE)[0]  # computes everything, stores the prompt
        assert cold.num_cached_tokens == 0 and cold.prompt_logprobs is not None
        assert conn.flush(timeout=60)
        warm = llm.generate(prompt, SAMPLE)[0]
        assert warm.num_cached_tokens == n - 1  # loaded from the tier
        assert conn.request_metrics(warm.request_id).connector_hit_tokens == n - 1
        assert max_diff(warm, cold, prompt=False) <= 1e-5
        scored = llm.generate(prompt, SCORE)[0]
        assert scored.num_cached_tokens == 0  # prompt logprobs: nothing loaded, every position computed
        assert conn.request_metrics(scored.request_id).connector_hit_tokens == 0
        assert max_diff(scored, cold) <= 1e-5
        assert_idle(llm, conn)


def test_warm_logprobs_blended_at_ratio_one_equal_cold(default_model_path: Path) -> None:
    tok = load_tokenizer(default_model_path)
    parts = [tok.encode("You are a careful assistant. Answer briefly.\n")]
    parts += [tok.encode(f"Document: {p}\n") for p in PARAGRAPHS[:2]]
    parts += [tok.encode("Question: what did the lighthouse keeper count? Answer:")]
    p = {"prompt_token_ids": [t for part in parts for t in part], "segment_lens": [len(x) for x in parts]}
    conn = build_connector({"tiers": ["cpu"], "chunk_size": 32, "blend": {"enabled": True, "ratio": 1.0}})
    with engine(default_model_path, conn, enable_prefix_caching=False, num_gpu_blocks=48) as llm:
        cold = llm.generate(p, SAMPLE)[0]  # no segment stored: each computed in context, stored
        assert conn.flush(timeout=60)
        assert blend_stats(conn)["segment_hits"] == 0
        warm = llm.generate(p, SAMPLE)[0]  # blended from the stored segments, all recomputed
        st = blend_stats(conn)
        assert st["requests"] == 2 and st["segment_hits"] > 0
        assert max_diff(warm, cold) <= 1e-5
        plain = llm.generate(p, SCORE)[0]  # prompt logprobs: never blended, a plain prefill
        assert blend_stats(conn)["requests"] == 2 and plain.num_cached_tokens == 0
        # the blend's own forward (the executor's layer loop) sums in another order
        assert max_diff(warm, plain, prompt=False) <= 1e-4
        again = llm.generate(p, SCORE)[0]
        assert blend_stats(conn)["requests"] == 2 and again.num_cached_tokens == 0
        assert max_diff(again, plain) <= 1e-5
        assert_idle(llm, conn)
