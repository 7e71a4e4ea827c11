"""Fixtures the connector's load tests share: one long prompt and its cold-run tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.text import long_text
from tests.fixtures.connector import CHUNK, engine, run


@pytest.fixture(scope="module")
def prompt_ids(default_model_path: Path) -> list[int]:
    """Token ids of a three-section prompt (several chunks, a partial last chunk and block)."""
    from engine.model_loader import load_tokenizer

    ids = load_tokenizer(default_model_path).encode(long_text(3))
    assert len(ids) % CHUNK and len(ids) % 16
    return ids


@pytest.fixture(scope="module")
def reference(default_model_path: Path, prompt_ids: list[int]) -> list[int]:
    """`prompt_ids`' greedy tokens on an engine with no connector and no prefix cache."""
    with engine(default_model_path, None, enable_prefix_caching=False) as llm:
        return run(llm, prompt_ids).outputs[0].token_ids
