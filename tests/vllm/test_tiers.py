"""A repeated 2k-token prompt is loaded from each tier by a real vLLM (prefix caching off),
with the tokens of the cold run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.connector import tier_url
from tests.fixtures.vllm import VllmLLM

TIERS = ["cpu", "disk", "redis", "kvtier"]


@pytest.mark.parametrize("tier", TIERS)
def test_the_second_run_loads_the_prompt_from_the_tier(tier: str, tmp_path: Path, request: pytest.FixtureRequest,
                                                       default_model_path: Path, prompt_2k: list[int]) -> None:
    url = tier_url(tier, tmp_path, request)
    llm = VllmLLM(default_model_path, {"tiers": [url], "chunk_size": 256}, tmp_path / "vllm.log")
    try:
        cold = llm.generate([prompt_2k])
        warm = llm.generate([prompt_2k])
    finally:
        llm.close()
    assert cold["outputs"][0]["cached"] == 0
    assert warm["outputs"][0]["tokens"] == cold["outputs"][0]["tokens"]
    assert warm["outputs"][0]["cached"] >= 0.9 * len(prompt_2k), llm.tail()
    loaded = warm["metrics"].get("kvtier:connector_hit_tokens_total", 0) - cold["metrics"].get(
        "kvtier:connector_hit_tokens_total", 0)
    assert loaded == warm["outputs"][0]["cached"]
