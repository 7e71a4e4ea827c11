"""Gemma 2 and Gemma 3 (text) on a paged KV cache.

Everything that makes them Gemma is configuration (engine/models/gemma_config.py) that the
shared layers (engine/layers, engine/models/base.py) act on:
- embeddings times sqrt(hidden), rounded to the model's dtype as transformers does;
- (1 + w) RMSNorm, four per layer ("sandwich": before and after attention and the MLP);
- a gelu-tanh gated MLP;
- attention scale `query_pre_attn_scalar ** -0.5`;
- soft-capped attention scores (Gemma 2: engine/softcap_attention.py and the CPU decode
  kernel) and final logits;
- sliding-window and global layers (`layer_types`), each kind with its own RoPE (Gemma 3's
  local base);
- Gemma 3's per-head q/k (1 + w) RMSNorm before RoPE.
The checkpoint's tensor names are the shared layers' own.
"""

from __future__ import annotations

from engine.layers.attention import Attention
from engine.layers.decoder import DecoderLayer
from engine.layers.mlp import GatedMLP
from engine.layers.norm import RMSNorm
from engine.models.base import CausalLM


class GemmaDecoderLayer(DecoderLayer):
    """A sandwich-norm decoder layer, its modules typed by their checkpoint names."""

    self_attn: Attention
    mlp: GatedMLP
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    pre_feedforward_layernorm: RMSNorm
    post_feedforward_layernorm: RMSNorm


class GemmaForCausalLM(CausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (text only) over a paged KV cache."""

    layer_class = GemmaDecoderLayer


__all__ = ["GemmaDecoderLayer", "GemmaForCausalLM"]
