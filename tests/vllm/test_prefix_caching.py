"""vLLM's own prefix cache together with kvtier's connector: the engine's hit and the
connector's are never double-counted, and `num_cached_tokens` is their sum."""

from __future__ import annotations

from pathlib import Path

from tests.fixtures.vllm import VllmLLM


def test_engine_hit_plus_connector_hit(tmp_path: Path, default_model_path: Path, prompt_2k: list[int]) -> None:
    llm = VllmLLM(default_model_path, {"tiers": ["cpu"], "chunk_size": 256}, tmp_path / "vllm.log",
                  prefix_caching=True)
    try:
        cold = llm.generate([prompt_2k])
        assert llm.command(op="reset_prefix_cache")["ok"]
        half = llm.generate([prompt_2k[:1024]])  # the connector loads it; vLLM caches its blocks
        warm = llm.generate([prompt_2k])  # vLLM's hit for the first half, the connector's after it
    finally:
        llm.close()
    assert half["outputs"][0]["cached"] == 1023
    m0, m1 = half["metrics"], warm["metrics"]
    engine_hit = m1["vllm:prefix_cache_hits"] - m0["vllm:prefix_cache_hits"]
    external = m1["vllm:external_prefix_cache_hits"] - m0["vllm:external_prefix_cache_hits"]
    loaded = m1["kvtier:connector_hit_tokens_total"] - m0["kvtier:connector_hit_tokens_total"]
    assert engine_hit >= 768 and external > 0
    assert loaded == external  # the connector loaded only what vLLM's cache did not hold
    assert warm["outputs"][0]["cached"] == engine_hit + external == 2047
    assert warm["outputs"][0]["tokens"] == cold["outputs"][0]["tokens"]
