"""Gemma 2 and Gemma 3 (text) against transformers; the proof itself is
tests/fixtures/families.py's, the attention features alone are tests/engine/test_gemma_attention.py's."""

from __future__ import annotations

from tests.fixtures.families import (  # noqa: F401 - the shared tests and fixture, collected here
    family_engine,
    make_family_fixture,
    test_engine_greedy_tokens_match_transformers,
    test_logits_match_transformers,
    test_switching_a_feature_off_fails_the_comparison,
)

family = make_family_fixture(["gemma2", "gemma3"])
