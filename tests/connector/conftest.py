"""Fixtures the connector's load tests share: one long prompt and its cold-run tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.connector.test_connector_e2e import make_llm, run
from tests.engine.text import long_text


@pytest.fixture(scope="module")
def prompt_ids(default_model_path: Path) -> list[int]:
    """Token ids of a three-section prompt (several chunks)."""
    from engine.model_loader import load_tokenizer

    return load_tokenizer(default_model_path).encode(long_text(3))


@pytest.fixture(scope="module")
def reference(default_model_path: Path, prompt_ids: list[int]) -> list[int]:
    """`prompt_ids`' greedy tokens on an engine with no connector and no prefix cache."""
    return run(make_llm(default_model_path, None, enable_prefix_caching=False), prompt_ids).outputs[0].token_ids
