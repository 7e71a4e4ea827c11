"""Dense families against transformers: Qwen3 (with YaRN), Phi-3 (longrope), OLMo 2, Llama
with YaRN and Granite (its multipliers); the proof itself is tests/fixtures/families.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from harness.families import FAMILIES, prompt_ids
from harness.model import FAMILY_TINY
from harness.paged import PagedDriver, load_tiny_pair
from tests.fixtures.families import (  # noqa: F401 - the shared tests and fixture, collected here
    family_engine,
    make_family_fixture,
    test_engine_greedy_tokens_match_transformers,
    test_logits_match_transformers,
    test_switching_a_feature_off_fails_the_comparison,
)

family = make_family_fixture(["qwen3", "phi3", "olmo2", "llama_yarn", "granite"])


def _hf_decode_logits(hf: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' last-position logits after `prompt`, then after each of `tokens` fed one
    at a time over its KV cache: `[1 + len(tokens), vocab]`."""
    from transformers import DynamicCache
    cache = DynamicCache(config=hf.config)
    with torch.inference_mode():
        rows = [hf(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]]
        for i, t in enumerate(tokens):
            pos = torch.tensor([[len(prompt) + i]])
            rows.append(hf(torch.tensor([[t]]), cache=cache, use_cache=True, position_ids=pos).logits[0, -1])
    return torch.stack(rows).float()


def test_phi3_long_factors_past_the_original_context(tmp_path: Path, default_model_path: Path) -> None:
    """A prompt inside Phi-3's original context (64 here), decoded past it over the KV cache:
    from position 64 on, transformers' rotary switches to the long factors, as the engine does.
    (transformers' generate goes further for Phi-3: it drops the cache at the crossing and
    recomputes the whole sequence with the long factors. The engine keeps the KV of a prefix a
    function of that prefix, which its prefix cache and the connector rely on; docs/models.md,
    "Phi-3's long factors".)"""
    overrides = {**FAMILY_TINY, **FAMILIES["phi3"], "max_position_embeddings": 1024,
                 "original_max_position_embeddings": 64}
    ours, hf, cfg, ckpt = load_tiny_pair(tmp_path, default_model_path, **overrides)
    rope = ours.model.rotary
    assert rope.long_from == 64 and rope.long_inv_freq is not None
    prompt = prompt_ids(50)
    tokens = prompt_ids(30)
    ref = _hf_decode_logits(hf, prompt, tokens)

    def decode() -> torch.Tensor:
        d = PagedDriver(ours)
        rows = [d.step([(0, prompt)])[0][-1]]
        rows += [d.step([(0, [t])])[0][-1] for t in tokens]
        return torch.stack(rows)

    assert float((decode() - ref).abs().max()) <= 1e-4
    rope.long_inv_freq, rope._cache = None, None  # short factors past 64 too: must differ there
    err = (decode() - ref).abs().amax(-1)
    assert float(err[:15].max()) <= 1e-4 and float(err[15:].min()) > 1e-3
