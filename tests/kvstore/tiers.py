"""Moved to tests/fixtures/tiers.py. This re-export stays only until
tests/kvstore/test_storage_manager.py (owned elsewhere) imports from there; then delete it."""

from tests.fixtures.tiers import TIER_KINDS, chunk, ckey, longest_calls_while_frozen, make_tier, tier_spec

__all__ = ["TIER_KINDS", "chunk", "ckey", "longest_calls_while_frozen", "make_tier", "tier_spec"]
