"""The model's linear layers on oneDNN with prepacked weights, and where that runs.

On CPU, `F.linear` goes to MKL's sgemm, which on this project's AMD machine runs its generic
code path: oneDNN (shipped inside torch) with the weight reordered once into its blocked
layout is 2-3x faster at every batch size, from a 1-token decode to a 2k-token prefill
(`benchmarks/bench_linear.py`). vLLM's CPU backend makes the same choice. Results agree with
`F.linear` to float rounding (a different summation order), not bit for bit.

The engine's `kernels="auto"` packs the linears where `onednn_supported` (CPU: fp32 always,
bf16 and fp16 where the CPU has the instructions); elsewhere (CUDA) they stay `nn.Linear`.
"""

from __future__ import annotations

import torch
from torch import nn


def onednn_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Returns whether oneDNN's prepacked linear runs for weights of `dtype` on `device`."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` through oneDNN, with W reordered once into oneDNN's layout.

    `weight` is that opaque (mkldnn-layout) tensor: it has W's shape and dtype but no strides,
    so nothing may read or index it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def pack_linears(module: nn.Module) -> int:
    """Replaces every `nn.Linear` under `module` by a PackedLinear of the same weights (the
    plain weights are then freed); returns how many were replaced."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias))
            count += 1
        else:
            count += pack_linears(child)
    return count

