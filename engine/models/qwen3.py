"""Qwen3 (dense): the Llama layout with per-head q/k RMSNorm before RoPE (ModelConfig.qk_norm
"head", set by its config hook) and q/k/v/o bias only when `attention_bias` says so."""

from __future__ import annotations

from engine.models.base import CausalLM


class Qwen3ForCausalLM(CausalLM):
    """Everything that differs from Llama is in ModelConfig (engine/models/family_configs.py)."""
