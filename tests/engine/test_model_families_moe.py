"""Sparse MoE families against transformers: Qwen3-MoE (norm_topk_prob, dense layers from
mlp_only_layers) and Mixtral (with a sliding window); the proof itself is
tests/fixtures/families.py's."""

from __future__ import annotations

from tests.fixtures.families import (  # noqa: F401 - the shared tests and fixture, collected here
    family_engine,
    make_family_fixture,
    test_engine_greedy_tokens_match_transformers,
    test_logits_match_transformers,
    test_switching_a_feature_off_fails_the_comparison,
)

family = make_family_fixture(["qwen3_moe", "mixtral"])
