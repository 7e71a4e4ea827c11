"""The sparse MoE MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k experts, each
expert is a gated MLP, and the token's output is the router-weighted sum of its experts'.

No Python loop over tokens: the (token, expert) assignments are sorted by expert once, each
expert runs one matmul over the rows routed to it (a loop over experts, as transformers and
vLLM's CPU path do), and the weighted rows are summed back per token with one `index_add_`.
Expert weights are stacked `[E, 2I, H]` (gate and up fused) and `[E, H, I]`.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.mlp import ACTIVATIONS
from engine.model_config import MoEConfig


class Experts(nn.Module):
    """Stacked expert weights; the checkpoint's names `experts.gate_up_proj` / `experts.down_proj`."""

    cpu_ops: ModuleType | None = None  # engine/cpu_ops.py's silu_and_mul, as GatedMLP's

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act = act
        self.act_fn = ACTIVATIONS[act]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Returns expert `e`'s gated MLP of rows `x` `[n, hidden]`."""
        gate_up = F.linear(x, self.gate_up_proj[e])
        if self.cpu_ops is not None and self.act == "silu" and gate_up.dtype == torch.float32:
            h = self.cpu_ops.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            h = self.act_fn(gate) * up
        return F.linear(h, self.down_proj[e])


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig, act: str) -> None:
        super().__init__()
        self.top_k = moe.top_k
        # Renormalise the top-k probabilities (a plain attribute: tests switch it off).
        self.norm_topk_prob = moe.norm_topk_prob
        # Weight the expert outputs in the input dtype (Qwen3-MoE) or in float32 (Mixtral).
        self.weights_in_input_dtype = True
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, hidden_size, moe.intermediate_size, act)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (weights `[T, k]`, expert ids `[T, k]`) of each token's top-k experts."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(x.dtype) if self.weights_in_input_dtype else weights), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        rows = order // self.top_k  # the token of each grouped assignment
        counts = torch.bincount(flat, minlength=self.experts.num_experts).tolist()
        routed = x.index_select(0, rows)
        w = weights.flatten().index_select(0, order).unsqueeze(-1)
        out = torch.empty_like(routed)
        start = 0
        for e, n in enumerate(counts):
            if n:
                y = self.experts.expert(e, routed[start:start + n])
                out[start:start + n] = (y * w[start:start + n]).to(x.dtype)
                start += n
        return torch.zeros_like(x).index_add_(0, rows, out)
