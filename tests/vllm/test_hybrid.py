"""A hybrid model (Gemma 3: five sliding-window layers to one full-attention layer) in a real
vLLM with kvtier's connector: vLLM keeps its hybrid KV cache manager (several KV cache groups),
a repeated prompt loads from the cpu tier, each sliding-window group only in its window, with
the cold run's tokens and logprobs; every block is freed after. Under vLLM's default load
failure policy ("fail", of which the connector warns once), a chunk that turns out corrupt is
reported as vLLM expects with several groups (the request, not its blocks), and vLLM ends
that request instead of serving wrong K/V."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from tests.fixtures.model import make_tiny_checkpoint
from tests.fixtures.vllm import VllmLLM

PROMPT = 1500
WINDOW = 256  # a sliding window the prompt exceeds: its groups load only the window's blocks


TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=4096, vocab_size=1000)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gemma3"), model_type="gemma3_text",
                                tokenizer_dir=default_model_path, **TINY, num_hidden_layers=6, head_dim=32,
                                sliding_window=WINDOW, layer_types=[*["sliding_attention"] * 5, "full_attention"])


def test_a_hybrid_model_loads_from_the_cpu_tier_with_the_hybrid_manager_on(gemma3: Path, tmp_path: Path) -> None:
    prompt = random.Random(0).choices(range(3, 1000), k=PROMPT)
    log = tmp_path / "vllm.log"
    disk = tmp_path / "kv"
    llm = VllmLLM(gemma3, {"tiers": ["cpu", f"disk://{disk}"], "chunk_size": 256}, log,
                  kv_load_failure_policy="fail")
    try:
        cold = llm.generate([prompt], logprobs=5)
        warm = llm.generate([prompt], logprobs=5)
        # reset_cache empties the cpu tier only: the next lookup finds the chunks on disk
        assert llm.command(op="reset_prefix_cache", connector=True)["ok"]
        files = list(disk.rglob("*.kvc"))
        assert len(files) >= -(-PROMPT // 256)
        for f in files:  # a flipped byte in each chunk's K/V: its checksum fails
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0xFF
            f.write_bytes(bytes(data))
        failed = llm.generate([prompt])
        usage = llm.generate([[5, 6, 7]], max_tokens=1)["metrics"]["vllm:kv_cache_usage_perc"]
    finally:
        llm.close()
    text = log.read_text(errors="replace")
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
