"""Sparse MoE families: Qwen3-MoE (Qwen3's attention) and Mixtral (Mistral's attention), their
sparse MLPs engine/layers/sparse_moe.py's SparseMoE.

Checkpoints name each expert's projections (`mlp.experts.<e>.gate_proj` / `up_proj` /
`down_proj`; Mixtral: `block_sparse_moe.experts.<e>.w1` / `w3` / `w2` and
`block_sparse_moe.gate`); they load into the stacked expert parameters by expert and shard.
A checkpoint holding the stacked tensors themselves (`mlp.experts.gate_up_proj`) loads whole.
"""

from __future__ import annotations

import re

from torch import nn

from engine.layers.sparse_moe import SparseMoE
from engine.model_config import ModelConfig
from engine.models.base import CausalLM
from engine.models.weights import Target

_EXPERT = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")
# Per-expert projection -> (stacked parameter, shard within it; None: the whole parameter).
_EXPERT_PROJ = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None),
                "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}


class MoECausalLM(CausalLM):
    # Expert outputs weighted in the input dtype (Qwen3-MoE) or in float32 (Mixtral).
    weights_in_input_dtype = True

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        if cfg.moe is None or layer_idx not in cfg.moe.layers:
            return super().make_mlp(cfg, layer_idx)
        moe = SparseMoE(cfg.hidden_size, cfg.moe, cfg.hidden_act)
        moe.weights_in_input_dtype = self.weights_in_input_dtype
        return moe

    def checkpoint_target(self, name: str) -> Target | None:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = _EXPERT.search(name)
        if m is None:
            return super().checkpoint_target(name)
        param, shard = _EXPERT_PROJ.get(m.group(2), (m.group(2), None))
        return Target(f"{name[:m.start()]}.experts.{param}", expert=int(m.group(1)), shard=shard)

    def num_experts(self, param: str) -> int | None:
        if self.config.moe is not None and param.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            return self.config.moe.num_experts
        return None


class Qwen3MoeForCausalLM(MoECausalLM):
    """Top-k of the softmax over experts, renormalised with `norm_topk_prob`."""


class MixtralForCausalLM(MoECausalLM):
    """Top-k of the softmax over experts, always renormalised, weighted in float32."""

    weights_in_input_dtype = False
