"""Self-attention over the paged KV cache: one fused q/k/v projection, optional q/k RMSNorm,
RoPE, the cache write, paged attention and the output projection.

Family switches are plain attributes read at every forward (`qk_norm`, `scale`), so a test
can turn a feature off on one instance and watch the oracle comparison fail.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.layers.norm import RMSNorm
from engine.model_config import ModelConfig
from engine.paged_attention import AttentionPlan, paged_attention, write_kv
from engine.rotary import RotaryEmbedding, apply_rotary


class Attention(nn.Module):
    cpu_ops: ModuleType | None = None  # as RMSNorm's

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_size = cfg.num_heads, cfg.num_kv_heads, cfg.head_size
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.attention_scale if cfg.attention_scale is not None else cfg.head_size ** -0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_out_bias)
        self.rotary = rotary
        self.sliding_window = cfg.layer_sliding_window(layer_idx)
        # Attention score soft-cap (Gemma 2), applied by the attention kernel when set.
        self.logit_softcap = cfg.attn_logit_softcap
        # q/k RMSNorm before RoPE: per head ("head", Qwen3) or over the projection ("full", OLMo 2).
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm is not None:
            head = cfg.qk_norm == "head"
            self.q_norm = RMSNorm(cfg.head_size if head else self.q_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
            self.k_norm = RMSNorm(cfg.head_size if head else self.kv_size, cfg.rms_norm_eps, cfg.norm_unit_offset)

    def _norm_qk(self, flat: torch.Tensor) -> None:
        """Applies the q/k norms to the q and k columns of the fused projection, in place."""
        t, q, kv = flat.shape[0], self.q_size, self.kv_size
        qs, ks = flat[:, :q], flat[:, q:q + kv]
        if self.qk_norm == "head":
            qs, ks = qs.view(t, self.num_heads, self.head_size), ks.view(t, self.num_kv_heads, self.head_size)
        qs.copy_(self.q_norm(qs))
        ks.copy_(self.k_norm(ks))

    def project_qkv(self, x: torch.Tensor,
                    positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns q `[T, Hq, D]`, k (after RoPE) and v `[T, Hkv, D]` for normed hidden states
        `x` `[T, hidden]` at `positions` `[T]` (views into one fused projection)."""
        t = x.shape[0]
        flat = self.qkv_proj(x)
        if self.qk_norm is not None:
            self._norm_qk(flat)
        qkv = flat.view(t, self.num_heads + 2 * self.num_kv_heads, self.head_size)
        qk_heads = self.num_heads + self.num_kv_heads
        cos_sin = self.rotary.cos_sin_cache(x.device, x.dtype)
        if self.cpu_ops is not None and flat.dtype == torch.float32 and flat.dim() == 2:
            self.cpu_ops.rotary_(flat, positions, cos_sin, qk_heads)  # q and k, in place
            return qkv[:, :self.num_heads], qkv[:, self.num_heads:qk_heads], qkv[:, qk_heads:]
        qk = apply_rotary(qkv[:, :qk_heads], positions, cos_sin)
        return qk[:, :self.num_heads], qk[:, self.num_heads:], qkv[:, qk_heads:]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               plan: AttentionPlan) -> torch.Tensor:
        """Returns the attention output `[T, Hq, D]` of the step's queries over their context."""
        return paged_attention(q, k, v, kv_cache, plan, self.scale, self.logit_softcap)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, plan: AttentionPlan,
                rows: tuple[torch.Tensor, AttentionPlan] | None = None) -> torch.Tensor:
        """Returns the branch output `[T, hidden]` for normed hidden states `x` `[T, hidden]`,
        after writing all T rows' K/V to `kv_cache`. `rows`: (row indices `[R]`, their plan as
        `AttentionMetadata.last_rows` builds it): attend and project only those rows, `[R, hidden]`."""
        q, k, v = self.project_qkv(x, positions)
        connector = meta.kv_connector
        if connector is not None:  # loaded context must be in place before we read the cache
            connector.wait_for_layer_load(self.layer_idx)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        if connector is not None:  # saving overlaps with this layer's attention
            connector.save_kv_layer(self.layer_idx, kv_cache, meta)
        if rows is not None:
            index, plan = rows
            if index.numel() == 0:
                return x.new_empty((0, x.shape[1]))
            q, k, v = q.index_select(0, index), k.index_select(0, index), v.index_select(0, index)
        o = self.attend(q, k, v, kv_cache, plan)
        return self.o_proj(o.reshape(q.shape[0], self.q_size))
