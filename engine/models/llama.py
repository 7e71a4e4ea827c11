"""The Llama family (Llama, Mistral, Qwen2, SmolLM) on a paged KV cache.

The variants differ only in config (qkv bias, o_proj bias, tied embeddings, rope scaling,
per-layer sliding window), all read into ModelConfig; the layers are the shared ones
(engine/layers). The Llama-specific names below type the modules CacheBlend runs layer by
layer (connector/blend).
"""

from __future__ import annotations

from typing import cast

from engine.layers.attention import Attention
from engine.layers.decoder import DecoderLayer
from engine.layers.mlp import GatedMLP
from engine.layers.norm import RMSNorm
from engine.models.base import CausalLM, DecoderModel


class LlamaDecoderLayer(DecoderLayer):
    """A pre-norm decoder layer, its modules typed by their checkpoint names."""

    self_attn: Attention
    mlp: GatedMLP
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm


class LlamaModel(DecoderModel):
    def decoder_layers(self) -> list[LlamaDecoderLayer]:  # type: ignore[override]
        return cast(list[LlamaDecoderLayer], list(self.layers))


class LlamaForCausalLM(CausalLM):
    """Llama-family causal LM over a paged KV cache (also registered for Mistral and Qwen2)."""

    model: LlamaModel
    model_class = LlamaModel
    layer_class = LlamaDecoderLayer


__all__ = ["LlamaDecoderLayer", "LlamaForCausalLM", "LlamaModel", "RMSNorm"]
