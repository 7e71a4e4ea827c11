"""OLMo 2: RMSNorm over the whole q and k projections before RoPE (ModelConfig.qk_norm "full"),
and the decoder layer's norms after attention and after the MLP instead of before them
(norm_layout "post": `post_attention_layernorm`, `post_feedforward_layernorm`)."""

from __future__ import annotations

from engine.models.base import CausalLM


class Olmo2ForCausalLM(CausalLM):
    """Everything that differs from Llama is in ModelConfig (engine/models/family_configs.py)."""
