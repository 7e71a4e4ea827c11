"""A repeated 2k-token prompt is loaded from each tier by a real vLLM (prefix caching off),
with the tokens of the cold run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.connector import tier_url
from tests.fixtures.vllm import VllmLLM

# (tier, use_layerwise): background loads from every tier; layer-by-layer loads in the
# request's first step (vLLM's synchronous path, its forward waiting per layer) from one.
CASES = [("cpu", False), ("disk", False), ("redis", False), ("kvtier", False), ("disk", True)]


@pytest.mark.parametrize(("tier", "layerwise"), CASES)
def test_the_second_run_loads_the_prompt_from_the_tier(tier: str, layerwise: bool, tmp_path: Path,
                                                       request: pytest.FixtureRequest, default_model_path: Path,
                                                       prompt_2k: list[int]) -> None:
    url = tier_url(tier, tmp_path, request)
    config = {"tiers": [url], "chunk_size": 256, "use_layerwise": layerwise}
    llm = VllmLLM(default_model_path, config, tmp_path / "vllm.log")
    try:
        if tier == "cpu":  # a request that asks not to be stored leaves nothing to load
            skipped = llm.generate([prompt_2k], kv_transfer_params={"kvtier.skip_save": True})
            assert skipped["metrics"].get("kvtier:stored_tokens_total", 0) == 0
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
