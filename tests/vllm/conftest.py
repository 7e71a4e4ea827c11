"""Fixtures for the vLLM tests: they run in vLLM's virtualenv (`make test-vllm`), on real vLLM
processes with the bundled model (harness/vllm.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from harness.text import long_text


@pytest.fixture(scope="session")
def prompt_2k(default_model_path: Path) -> list[int]:
    """2048 token ids of English text (the issue's 2k-token prompt)."""
    tok = AutoTokenizer.from_pretrained(default_model_path)
    ids = tok(long_text(80))["input_ids"]
    assert len(ids) >= 2048
    return ids[:2048]
