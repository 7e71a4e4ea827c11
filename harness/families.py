"""The model families the engine runs, as tiny random checkpoints' config overrides (over
harness/model.py's FAMILY_TINY), and their prompts: shared by the family proof
(tests/fixtures/families.py) and the benchmarks."""

from __future__ import annotations

import random
from typing import Any

from harness.model import FAMILY_TINY

LENGTHS = (7, 300, 1500)
DECODE = 6
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 256}
# Gemma's shared sizes: a window the 300- and 1500-token prompts exceed, and an attention scale
# (query_pre_attn_scalar ** -0.5) other than head_dim ** -0.5.
GEMMA = dict(head_dim=32, sliding_window=128, query_pre_attn_scalar=24)

FAMILIES: dict[str, dict[str, Any]] = {
    # Qwen3 with YaRN: per-head q/k norm, q/k/v/o bias from attention_bias.
    "qwen3": dict(model_type="qwen3", head_dim=32, attention_bias=True, rope_parameters=YARN),
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=32, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1]),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=128),
    # Longrope with the 1500-token prompt inside the original context: short factors and the
    # attention factor (max 8192 / original 2048); the long factors: test_phi3_long_factors.
    "phi3": dict(model_type="phi3", max_position_embeddings=8192, original_max_position_embeddings=2048,
                 rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(16)],
                               "long_factor": [1.0 + 0.5 * i for i in range(16)]}),
    "olmo2": dict(model_type="olmo2", attention_bias=True),
    "llama_yarn": dict(model_type="llama", rope_parameters={**YARN, "beta_fast": 16, "attention_factor": 1.3}),
    # Gemma 2: score and logit caps of 10 and 8 (the real 50 and 30 barely bite on these
    # weights); layers 0 and 2 slide, layer 1 is global. Transformers runs it eager (its SDPA
    # cannot cap).
    "gemma2": dict(model_type="gemma2", **GEMMA, attn_logit_softcapping=10.0, final_logit_softcapping=8.0),
    # Gemma 3: a global layer between two sliding ones, the global RoPE linearly scaled, the
    # local base far from it.
    "gemma3": dict(model_type="gemma3_text", **GEMMA,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
    # Granite with granite-3's multipliers (attention_multiplier far from head_dim ** -0.5), and
    # biases on q/k/v/o and the MLP.
    "granite": dict(model_type="granite", embedding_multiplier=12.0, residual_multiplier=0.22,
                    attention_multiplier=0.0156, logits_scaling=8.0, attention_bias=True, mlp_bias=True),
}


def prompt_ids(n: int) -> list[int]:
    return random.Random(n).choices(range(3, FAMILY_TINY["vocab_size"]), k=n)
