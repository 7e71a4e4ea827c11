"""Moved to tests/fixtures/text.py. This re-export stays only until tests/connector/ and
tests/engine/test_kv_connector_hooks.py (owned elsewhere) import from there; then delete it."""

from tests.fixtures.text import PARAGRAPHS, long_text

__all__ = ["PARAGRAPHS", "long_text"]
