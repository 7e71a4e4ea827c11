"""The gated MLP: down(act(gate(x)) * up(x)), gate and up fused into one projection."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# hidden_act name (transformers' ACT2FN key) -> the activation.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}


# Rows per pass of the fused CPU path: a 4k-token prefill in passes of 2048 rows keeps the
# [rows, 2 * intermediate] activations (25 MB at SmolLM2's sizes, vs 50) in the L3 cache,
# which makes its linears faster (docs/results.md).
_ROWS_PER_PASS = 2048


class GatedMLP(nn.Module):
    cpu_ops: ModuleType | None = None  # engine/cpu_ops.py's silu_and_mul, as RMSNorm's

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 act: str = "silu") -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = act
        self.act_fn = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_ops is not None and self.act == "silu" and x.dtype == torch.float32 and x.dim() == 2:
            if x.shape[0] <= _ROWS_PER_PASS:
                return cast(torch.Tensor, self.down_proj(self.cpu_ops.silu_and_mul(self.gate_up_proj(x))))
            out = x.new_empty(x.shape)
            for start in range(0, x.shape[0], _ROWS_PER_PASS):
                out[start:start + _ROWS_PER_PASS] = self.forward(x[start:start + _ROWS_PER_PASS])
            return out
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return cast(torch.Tensor, self.down_proj(self.act_fn(gate) * up))
