"""The Llama family (Llama, Mistral, Qwen2, SmolLM) on a paged KV cache.

One implementation: the variants differ only in config flags (qkv bias, o_proj bias, tied
embeddings, rope scaling, per-layer sliding window). q/k/v and gate/up are fused into one
matmul each at load time.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.linear_backend import PackedLinear, pack_linears
from engine.model_config import ModelConfig
from engine.paged_attention import AttentionPlan, build_plan, paged_attention, write_kv
from engine.rotary import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    # engine/cpu_ops.py's fused kernels (float32 rows on CPU), when the loader enabled them.
    cpu_ops: ModuleType | None = None

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def _fused(self, x: torch.Tensor) -> bool:
        return self.cpu_ops is not None and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused(x):
            return cast(torch.Tensor, self.cpu_ops.rms_norm(x, self.weight, self.eps))  # type: ignore[union-attr]
        # Normalise in float32 and scale in the input dtype, as HF does, so bf16 matches it.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this norm of residual + x, residual + x); the fused kernel adds into
        `residual` in place (the caller's residual stream), the PyTorch path makes a new one."""
        if self._fused(x) and residual.is_contiguous():
            return self.cpu_ops.add_rms_norm(x, residual, self.weight, self.eps), residual  # type: ignore[union-attr]
        residual = residual + x
        return self(residual), residual


class LlamaAttention(nn.Module):
    cpu_ops: ModuleType | None = None  # as RMSNorm's

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_size = cfg.num_heads, cfg.num_kv_heads, cfg.head_size
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_size ** -0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_out_bias)
        self.rotary = rotary

    def project_qkv(self, x: torch.Tensor,
                    positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns q `[T, Hq, D]`, k (after RoPE) and v `[T, Hkv, D]` for normed hidden states
        `x` `[T, hidden]` at `positions` `[T]` (views into one fused projection)."""
        t = x.shape[0]
        flat = self.qkv_proj(x)
        qkv = flat.view(t, self.num_heads + 2 * self.num_kv_heads, self.head_size)
        qk_heads = self.num_heads + self.num_kv_heads
        cos_sin = self.rotary.cos_sin_cache(x.device, x.dtype)
        if self.cpu_ops is not None and flat.dtype == torch.float32 and flat.dim() == 2:
            self.cpu_ops.rotary_(flat, positions, cos_sin, qk_heads)  # q and k, in place
            return qkv[:, :self.num_heads], qkv[:, self.num_heads:qk_heads], qkv[:, qk_heads:]
        qk = apply_rotary(qkv[:, :qk_heads], positions, cos_sin)
        return qk[:, :self.num_heads], qk[:, self.num_heads:], qkv[:, qk_heads:]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, plan: AttentionPlan) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.project_qkv(x, positions)
        connector = meta.kv_connector
        if connector is not None:  # loaded context must be in place before we read the cache
            connector.wait_for_layer_load(self.layer_idx)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        if connector is not None:  # saving overlaps with this layer's attention
            connector.save_kv_layer(self.layer_idx, kv_cache, meta)
        o = paged_attention(q, k, v, kv_cache, plan, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    cpu_ops: ModuleType | None = None  # as RMSNorm's

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.cpu_ops is not None and gate_up.dtype == torch.float32 and gate_up.dim() == 2:
            return cast(torch.Tensor, self.down_proj(self.cpu_ops.silu_and_mul(gate_up)))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return cast(torch.Tensor, self.down_proj(F.silu(gate) * up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                plan: AttentionPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it is added): the next
        layer's norm adds them, so each residual add rides in a norm (vLLM's layout). The
        first layer takes `residual` None and its input as the stream."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, positions, kv_cache, meta, plan)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.head_size, cfg.max_position_embeddings,
                                      cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, self.rotary)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """Returns the decoder layers in order, typed (nn.ModuleList types its items as Module)."""
        return cast(list[LlamaDecoderLayer], list(self.layers))


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache (also registered for Mistral and Qwen2)."""

    # HF checkpoint name fragment -> (our fused parameter, shard index within it).
    _FUSED = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        # nn.Linear, or PackedLinear after pack_linears; None while tied to the embedding.
        self.lm_head: nn.Module | None = (None if config.tie_word_embeddings
                                          else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        # Per layer: the sliding window it attends over (None: full attention).
        self.layer_windows = [config.layer_sliding_window(i) for i in range(config.num_layers)]
        # engine/cpu_ops.py's compiled kernels, once enable_cpu_ops gave them (CPU only).
        self.cpu_ops: ModuleType | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Runs one flat batch of `T` new tokens; writes their K/V into `kv_caches` (one tensor
        per layer, K after RoPE) and returns the final-normed hidden states `[T, hidden]`."""
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(f"expected {self.config.num_layers} kv caches, got {len(kv_caches)}")
        # One plan per distinct window that bites this step: a window no shorter than every
        # sequence is full attention, so such layers share the full-attention plan.
        longest = max(attn_metadata.seq_lens, default=0)
        windows = [w if w is not None and w < longest else None for w in self.layer_windows]
        dtype = self.model.embed_tokens.weight.dtype
        plans = {w: build_plan(attn_metadata, input_ids.device, dtype, w, self.cpu_ops) for w in set(windows)}
        num_tokens = next(iter(plans.values())).num_tokens
        if not num_tokens == input_ids.shape[0] == positions.shape[0]:
            raise ValueError(f"attn_metadata describes {num_tokens} tokens, input_ids has "
                             f"{input_ids.shape[0]}, positions {positions.shape[0]}")
        x = self.model.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, kv_cache, w in zip(self.model.layers, kv_caches, windows):
            x, residual = layer(x, residual, positions, kv_cache, attn_metadata, plans[w])
        if residual is None:  # no layers
            return cast(torch.Tensor, self.model.norm(x))
        return self.model.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Returns float32 logits `[N, vocab]` for hidden states `[N, hidden]`."""
        if self.lm_head is None:
            return F.linear(hidden_states, self.model.embed_tokens.weight).float()
        return cast(torch.Tensor, self.lm_head(hidden_states)).float()

    def enable_cpu_ops(self, ops: ModuleType) -> None:
        """Runs decode attention, RoPE, the norms and the MLP activation on engine/cpu_ops.py's
        compiled kernels (float32 on CPU; other dtypes keep PyTorch's ops)."""
        self.cpu_ops = ops
        for module in self.modules():
            if isinstance(module, (RMSNorm, LlamaMLP, LlamaAttention)):
                module.cpu_ops = ops

    def pack_linears(self) -> None:
        """Moves every linear layer to oneDNN with prepacked weights (engine/linear_backend.py),
        the logits projection included: a tied one gets a packed copy of the embedding, which
        the token lookup still reads. Call once, after load_weights."""
        pack_linears(self)
        if self.lm_head is None:
            self.lm_head = PackedLinear(self.model.embed_tokens.weight, None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named tensors into our (fused) parameters. Raises ValueError on an unknown
        name, a shape mismatch, or any parameter (or fused shard) left unloaded."""
        cfg = self.config
        shard_sizes = {".qkv_proj.": [cfg.q_size, cfg.kv_size, cfg.kv_size],
                       ".gate_up_proj.": [cfg.intermediate_size] * 2}
        params = dict(self.named_parameters())
        # Every (parameter, shard) the checkpoint must provide; shard None = the whole tensor.
        expected: set[tuple[str, int | None]] = set()
        for n in params:
            fused = next((f for f in shard_sizes if f in n), None)
            if fused is None:
                expected.add((n, None))
            else:
                expected.update((n, i) for i in range(len(shard_sizes[fused])))
        loaded: set[tuple[str, int | None]] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints still carry a copy
            target, fused, shard = name, None, None
            for frag, (fused_frag, idx) in self._FUSED.items():
                if frag in name:
                    target, fused, shard = name.replace(frag, fused_frag), fused_frag, idx
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {cfg.architecture}")
            dst: torch.Tensor = param
            if fused is not None and shard is not None:  # set together above
                sizes = shard_sizes[fused]
                dst = param.narrow(0, sum(sizes[:shard]), sizes[shard])
            _check_shape(name, tensor, dst.shape)
            with torch.no_grad():
                dst.copy_(tensor)
            loaded.add((target, shard))
        missing = sorted({n for n, _ in expected - loaded})
        if missing:
            raise ValueError(f"checkpoint is missing weights for {missing[:8]}")


def _check_shape(name: str, tensor: torch.Tensor, shape: torch.Size) -> None:
    if tensor.shape != shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(shape)}")
