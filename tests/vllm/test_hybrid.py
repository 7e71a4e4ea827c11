"""Hybrid models (Gemma 3: five sliding-window layers to one full-attention layer; Gemma 2:
sliding and full layers alternating) in a real vLLM with kvtier's connector: vLLM keeps its
hybrid KV cache manager (several KV cache groups), a repeated prompt loads from the cpu tier,
each sliding-window group only in its window, with the cold run's tokens and logprobs; every
block is freed after. Under vLLM's default load failure policy ("fail", of which the connector
warns once), a chunk that turns out corrupt is reported as vLLM expects with several groups
(the request, not its blocks), and vLLM ends that request instead of serving wrong K/V."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.model import make_tiny_checkpoint
from harness.vllm import VllmLLM, close_together, start_together

PROMPT = 1500
WINDOW = 256  # a sliding window the prompt exceeds: its groups load only the window's blocks


TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=4096, vocab_size=1000, head_dim=32, sliding_window=WINDOW)
MODELS: dict[str, dict[str, Any]] = {
    "gemma3": dict(model_type="gemma3_text", num_hidden_layers=6,
                   layer_types=[*["sliding_attention"] * 5, "full_attention"]),
    "gemma2": dict(model_type="gemma2", num_hidden_layers=4),  # transformers alternates the kinds
}


@pytest.fixture(scope="module")
def hybrid_llms(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Iterator[dict[str, VllmLLM]]:
    """One vLLM per model, each with a cpu and a disk tier (`llm.log.parent / "kv"`), started
    side by side."""
    def starter(name: str) -> Any:
        tmp = tmp_path_factory.mktemp(name)
        model = make_tiny_checkpoint(tmp, tokenizer_dir=default_model_path, **TINY, **MODELS[name])
        config = {"tiers": ["cpu", f"disk://{tmp / 'kv'}"], "chunk_size": 256}
        return lambda: VllmLLM(model, config, tmp / "vllm.log", kv_load_failure_policy="fail")
    llms = dict(zip(MODELS, start_together(*[starter(name) for name in MODELS])))
    yield llms
    close_together(*llms.values())


@pytest.mark.parametrize("name", list(MODELS))
def test_a_hybrid_model_loads_from_the_cpu_tier_with_the_hybrid_manager_on(
        name: str, hybrid_llms: dict[str, VllmLLM]) -> None:
    llm = hybrid_llms[name]
    prompt = random.Random(0).choices(range(3, 1000), k=PROMPT)
    cold = llm.generate([prompt], logprobs=5)
    warm = llm.generate([prompt], logprobs=5)
    # reset_cache empties the cpu tier only: the next lookup finds the chunks on disk
    assert llm.command(op="reset_prefix_cache", connector=True)["ok"]
    files = list((llm.log.parent / "kv").rglob("*.kvc"))
    assert len(files) >= -(-PROMPT // 256)
    for f in files:  # a flipped byte in each chunk's K/V: its checksum fails
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    failed = llm.generate([prompt])
    usage = llm.generate([[5, 6, 7]], max_tokens=1)["metrics"]["vllm:kv_cache_usage_perc"]
    text = llm.log.read_text(errors="replace")
    assert "Turning off hybrid kv cache manager" not in text
    groups = re.search(r"in (\d+) KV cache group", text)
    assert groups is not None and int(groups[1]) > 1, llm.tail()
    assert text.count("KVTierConnector: kv_load_failure_policy='fail'") == 1
    assert cold["outputs"][0]["cached"] == 0
    assert warm["outputs"][0]["cached"] >= 0.9 * PROMPT, llm.tail()
    assert warm["outputs"][0]["tokens"] == cold["outputs"][0]["tokens"]
    for c, w in zip(cold["outputs"][0]["logprobs"], warm["outputs"][0]["logprobs"], strict=True):
        assert c.keys() == w.keys()
        assert max(abs(c[t] - w[t]) for t in c) <= 1e-3
    assert warm["metrics"]["vllm:kv_cache_usage_perc"] == 0
    assert failed["outputs"][0]["finish_reason"] == "error", llm.tail()
    assert usage == 0
