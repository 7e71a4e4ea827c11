"""The decoder-only causal LM every family is: embeddings, decoder layers over the paged cache,
a final norm and the logits.

A family subclasses `CausalLM`; what differs is read from ModelConfig's features (norm layout,
q/k norm, attention scale, windows, per-layer RoPE, soft-caps, multipliers, ...) or set through
its hooks: `make_mlp` (a different MLP, e.g. sparse experts) and `checkpoint_target`
(checkpoint naming).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.layers.attention import Attention
from engine.layers.decoder import DecoderLayer
from engine.layers.mlp import GatedMLP
from engine.layers.norm import RMSNorm
from engine.layers.sparse_moe import Experts
from engine.linear_backend import LinearPacker, pack_linears
from engine.model_config import ModelConfig
from engine.models.weights import Target, load_into
from engine.paged_attention import AttentionPlan, build_plan
from engine.rotary import RotaryEmbedding


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, make_mlp: Callable[[ModelConfig, int], nn.Module],
                 layer_class: type[DecoderLayer] = DecoderLayer) -> None:
        super().__init__()
        # One RoPE table per distinct (theta, scaling); `rotary` is the full-attention layers'.
        self.rotary = RotaryEmbedding(cfg.head_size, cfg.max_position_embeddings,
                                      cfg.rope_theta, cfg.rope_scaling)
        ropes = {repr((cfg.rope_theta, cfg.rope_scaling)): self.rotary}
        # Uninitialised: load_model overwrites every weight, and nn.Embedding's N(0, 1) init on
        # the meta device imports torch._dynamo (~1 s of every engine start).
        self.embed_tokens = nn.Embedding.from_pretrained(torch.empty(cfg.vocab_size, cfg.hidden_size),
                                                         freeze=False)
        layers = []
        for i in range(cfg.num_layers):
            theta, scaling = cfg.layer_rope(i)
            key = repr((theta, scaling))
            if key not in ropes:
                ropes[key] = RotaryEmbedding(cfg.head_size, cfg.max_position_embeddings, theta, scaling)
            layers.append(layer_class(cfg, i, ropes[key], make_mlp(cfg, i)))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        # Embeddings are multiplied by this rounded to the model's dtype, as transformers' Gemma
        # does with sqrt(hidden). transformers' Granite multiplies by the float instead: the
        # same product whenever the multiplier is exact in the dtype (12 in its published configs).
        self.embedding_scale = cfg.embedding_scale

    def decoder_layers(self) -> list[DecoderLayer]:
        """Returns the decoder layers in order, typed (nn.ModuleList types its items as Module)."""
        return cast(list[DecoderLayer], list(self.layers))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Returns the (scaled) embeddings `[T, hidden]` of `input_ids` `[T]`."""
        x = cast(torch.Tensor, self.embed_tokens(input_ids))
        if self.embedding_scale is not None:
            x = x * torch.tensor(self.embedding_scale, dtype=x.dtype)
        return x


class CausalLM(nn.Module):
    """A decoder-only causal LM over a paged KV cache."""

    model_class: type[DecoderModel] = DecoderModel
    layer_class: type[DecoderLayer] = DecoderLayer
    # Checkpoint name fragment -> (our fused parameter's fragment, shard index within it).
    fused_names: dict[str, tuple[str, int]] = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_class(config, self.make_mlp, self.layer_class)
        # nn.Linear, or a packed linear after pack_linears; None while tied to the embedding.
        self.lm_head: nn.Module | None = (None if config.tie_word_embeddings
                                          else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        # Per layer: the sliding window it attends over (None: full attention).
        self.layer_windows = [config.layer_sliding_window(i) for i in range(config.num_layers)]
        # cap * tanh(logits / cap) on the final logits (Gemma 2), None: off.
        self.final_logit_softcap = config.final_logit_softcap
        # The final logits divided by this (Granite's logits_scaling), None: off.
        self.final_logit_divisor = config.final_logit_divisor
        # engine/cpu_ops.py's compiled kernels, once enable_cpu_ops gave them (CPU only).
        self.cpu_ops: ModuleType | None = None

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        """Returns layer `layer_idx`'s MLP (the dense gated MLP; MoE families override)."""
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata,
                last_of: list[int] | None = None) -> torch.Tensor:
        """Runs one flat batch of `T` new tokens; writes their K/V into `kv_caches` (one tensor
        per layer, K after RoPE) and returns the final-normed hidden states `[T, hidden]`.
        `last_of`: only the last rows of these sequences (indices into the metadata's), in that
        order, are returned; the last layer then attends and runs its MLP for those rows alone
        (a 4k prompt's 1 of 4096), every row's K/V still written."""
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
        x = self.model.embed(input_ids)
        residual: torch.Tensor | None = None
        layers = self.model.decoder_layers()
        last: tuple[torch.Tensor, AttentionPlan] | None = None
        if last_of is not None:
            index, last_meta = attn_metadata.last_rows(last_of)
            last = (torch.tensor(index, dtype=torch.long, device=input_ids.device),
                    build_plan(last_meta, input_ids.device, dtype, windows[-1] if windows else None, self.cpu_ops))
        for i, (layer, kv_cache, w) in enumerate(zip(layers, kv_caches, windows)):
            rows = last if i == len(layers) - 1 else None
            x, residual = layer(x, residual, positions, kv_cache, attn_metadata, plans[w], rows)
        if residual is None:  # no layers
            x = cast(torch.Tensor, self.model.norm(x))
            return x if last is None else x.index_select(0, last[0])
        if x.shape[0] == 0:  # no row asked for
            return x
        return self.model.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Returns float32 logits `[N, vocab]` for hidden states `[N, hidden]`."""
        if self.lm_head is None:
            logits = F.linear(hidden_states, self.model.embed_tokens.weight).float()
        else:
            logits = cast(torch.Tensor, self.lm_head(hidden_states)).float()
        if self.final_logit_divisor is not None:
            logits = logits / self.final_logit_divisor
        cap = self.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def enable_cpu_ops(self, ops: ModuleType) -> None:
        """Runs decode attention, RoPE, the norms and the MLP activation on engine/cpu_ops.py's
        compiled kernels (float32 on CPU; other dtypes keep PyTorch's ops)."""
        self.cpu_ops = ops
        for module in self.modules():
            if isinstance(module, (RMSNorm, GatedMLP, Attention, Experts)):
                module.cpu_ops = ops

    def pack_linears(self, packer: LinearPacker) -> None:
        """Replaces every linear layer by `packer(weight, bias)` (engine/linear_backend.py), the
        logits projection included: a tied one gets a packed copy of the embedding, which the
        token lookup still reads. Call once, after load_weights."""
        pack_linears(self, packer)
        if self.lm_head is None:
            self.lm_head = packer(self.model.embed_tokens.weight, None)

    def checkpoint_target(self, name: str) -> Target | None:
        """Returns where checkpoint tensor `name` goes (None: skip it): our fused parameters
        take q/k/v and gate/up by shard, every other name maps to itself."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: some checkpoints still carry a copy
        for frag, (fused, shard) in self.fused_names.items():
            if frag in name:
                return Target(name.replace(frag, fused), shard=shard)
        return Target(name)

    def shard_sizes(self, param: str) -> list[int] | None:
        """Returns the shard sizes of a fused parameter (None if `param` is not fused)."""
        cfg = self.config
        if ".qkv_proj." in param:
            return [cfg.q_size, cfg.kv_size, cfg.kv_size]
        if ".gate_up_proj." in param or param.endswith(".gate_up_proj"):
            mlp = self.get_submodule(param.rsplit(".gate_up_proj", 1)[0])
            size = getattr(mlp, "intermediate_size", cfg.intermediate_size)
            return [int(size)] * 2
        return None

    def num_experts(self, param: str) -> int | None:
        """Returns the expert count of a stacked expert parameter (None: not stacked)."""
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named tensors into our (fused) parameters. Raises ValueError on an unknown
        name, a shape mismatch, or any parameter (or fused shard) left unloaded."""
        load_into(dict(self.named_parameters()), weights, self.checkpoint_target, self.shard_sizes,
                  self.num_experts, self.config.architecture)
