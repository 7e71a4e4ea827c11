"""The decoder layer: attention and an MLP, each a residual branch, with the norms where the
family puts them (`ModelConfig.norm_layout`):

- "pre" (Llama, Qwen, Mistral, Phi-3): norm before each branch
  (`input_layernorm`, `post_attention_layernorm` before the MLP);
- "post" (OLMo 2): norm after each branch, on its output
  (`post_attention_layernorm`, `post_feedforward_layernorm`);
- "sandwich" (Gemma 2/3): both (`input_layernorm`, `post_attention_layernorm`,
  `pre_feedforward_layernorm`, `post_feedforward_layernorm`).

With `ModelConfig.residual_scale` (Granite) each branch output is multiplied by it before it
joins the residual stream. Modules carry the checkpoint's names. A layer returns (branch
output, residual stream before it is added): the next layer's first norm adds them, so each
residual add rides in a fused norm where the layout has one there (vLLM's layout).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.layers.attention import Attention
from engine.layers.norm import RMSNorm
from engine.model_config import ModelConfig
from engine.paged_attention import AttentionPlan
from engine.rotary import RotaryEmbedding

# layout -> role -> the checkpoint's module name. Roles: before / after attention, before /
# after the MLP.
NORM_LAYOUTS: dict[str, dict[str, str]] = {
    "pre": {"attn_in": "input_layernorm", "mlp_in": "post_attention_layernorm"},
    "post": {"attn_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"},
    "sandwich": {"attn_in": "input_layernorm", "attn_out": "post_attention_layernorm",
                 "mlp_in": "pre_feedforward_layernorm", "mlp_out": "post_feedforward_layernorm"},
}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module) -> None:
        super().__init__()
        if cfg.norm_layout not in NORM_LAYOUTS:
            raise ValueError(f"unknown norm layout {cfg.norm_layout!r}; known: {sorted(NORM_LAYOUTS)}")
        self.self_attn = Attention(cfg, layer_idx, rotary)
        self.mlp = mlp
        self.norm_roles = NORM_LAYOUTS[cfg.norm_layout]
        # A plain attribute read at every forward, as Attention's switches (a test turns it off).
        self.residual_scale = cfg.residual_scale
        for name in self.norm_roles.values():
            self.add_module(name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset))

    def norm(self, role: str) -> RMSNorm | None:
        """Returns the norm in `role` ("attn_in", "attn_out", "mlp_in", "mlp_out") or None."""
        name = self.norm_roles.get(role)
        return None if name is None else cast(RMSNorm, self._modules[name])

    @staticmethod
    def _enter(norm: RMSNorm | None, x: torch.Tensor,
               residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (the branch input, the residual stream) for stream = residual + x (x alone
        when `residual` is None), normed when the branch has an input norm."""
        if norm is None:
            stream = x if residual is None else residual + x
            return stream, stream
        if residual is None:
            return norm(x), x
        return norm.add_forward(x, residual)

    def attention_input(self, x: torch.Tensor,
                        residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (the attention branch's input, the residual stream) for the previous layer's
        (branch output `x`, stream `residual`); the first layer takes `residual` None."""
        return self._enter(self.norm("attn_in"), x, residual)

    def after_attention(self, attn_out: torch.Tensor,
                        residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (the MLP branch output, the residual stream before it is added) for the
        attention branch's output `attn_out` (after `o_proj`); both branch outputs scaled by
        `residual_scale` when set."""
        if (out := self.norm("attn_out")) is not None:
            attn_out = out(attn_out)
        h, residual = self._enter(self.norm("mlp_in"), self._scaled(attn_out), residual)
        h = self.mlp(h)
        if (out := self.norm("mlp_out")) is not None:
            h = out(h)
        return self._scaled(h), residual

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        # A Python float, so half precision multiplies by its float32 value (not rounded to the
        # dtype first), as transformers' Granite does.
        return branch if self.residual_scale is None else branch * self.residual_scale

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                plan: AttentionPlan,
                rows: tuple[torch.Tensor, AttentionPlan] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP branch output, the residual stream before it is added).
        The first layer takes `residual` None and its input as the stream. `rows`: as
        `Attention.forward`'s; every row's K/V is written, and both outputs hold only those rows.
        CacheBlend (connector/blend/executor.py) runs the same two halves around its own attention."""
        h, residual = self.attention_input(x, residual)
        attn_out = self.self_attn(h, positions, kv_cache, meta, plan, rows)
        if rows is not None:
            residual = residual.index_select(0, rows[0])
            if residual.shape[0] == 0:
                return attn_out, residual
        return self.after_attention(attn_out, residual)
