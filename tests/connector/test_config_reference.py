"""docs/configuration.md lists every config key and every LMCache key the code knows: its
tables are the code's tables rendered, so a key added without a row fails here."""

from __future__ import annotations

from pathlib import Path

from connector.config_reference import render
from connector.connector_config import all_settings
from connector.lmcache_compat import LMCACHE_KEYS

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_doc_tables_match_the_code() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert render(text) == text, "run: python -m connector.config_reference docs/configuration.md"


def test_doc_lists_every_key_its_variable_and_every_lmcache_key() -> None:
    text = DOC.read_text(encoding="utf-8")
    for s in all_settings():
        assert f"| `{s.key}` | `{s.env}`" in text, s.key
    for k in LMCACHE_KEYS:
        assert f"| `{k.name}` |" in text, k.name


def test_render_replaces_a_stale_table() -> None:
    stale = "x\n<!-- generated:settings -->\n| old |\n<!-- end generated:settings -->\ny\n"
    fresh = render(stale)
    assert "| old |" not in fresh and "`KVTIER_CHUNK_SIZE`" in fresh and fresh.endswith("-->\ny\n")
