"""Phi-3: the Llama layout; its checkpoints store q/k/v as one `qkv_proj` and gate/up as one
`gate_up_proj`, the fused parameters this engine already uses (loaded whole), and its long
context variants use longrope (engine/rotary.py: short/long factors, attention factor)."""

from __future__ import annotations

from engine.models.base import CausalLM


class Phi3ForCausalLM(CausalLM):
    """Everything that differs from Llama is in ModelConfig (engine/models/family_configs.py)."""
