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
        gate_up = self.gate_up_proj(x)
        if (self.cpu_ops is not None and self.act == "silu" and gate_up.dtype == torch.float32
                and gate_up.dim() == 2):
            return cast(torch.Tensor, self.down_proj(self.cpu_ops.silu_and_mul(gate_up)))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return cast(torch.Tensor, self.down_proj(self.act_fn(gate) * up))
