"""Granite (dense): the Llama layout with four multipliers, all ModelConfig fields the shared
layers act on (set by its config hook, engine/models/family_configs.py): embeddings times
`embedding_scale`, each branch output times `residual_scale` before the residual add
(engine/layers/decoder.py), scores scaled by `attention_scale` on every attention path, and
the final logits divided by `final_logit_divisor`."""

from __future__ import annotations

from engine.models.base import CausalLM


class GraniteForCausalLM(CausalLM):
    """Everything that differs from Llama is in ModelConfig (engine/models/family_configs.py)."""
