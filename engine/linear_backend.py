"""The model's linear layers on oneDNN with prepacked weights, and where that runs.

On CPU, `F.linear` goes to MKL's sgemm, which on this project's AMD machine runs its generic
code path: oneDNN (shipped inside torch) with the weight reordered once into its blocked
layout is 2-3x faster at every batch size, from a 1-token decode to a 2k-token prefill
(`benchmarks/bench_kernels.py`, `bench_linear`). vLLM's CPU backend makes the same choice.
Results agree with `F.linear` to float rounding (a different summation order), not bit for bit.

oneDNN compiles and caches one primitive (with its own scratchpad) per distinct input row
count, up to 1024 of them. A server sees every prompt length, so its RSS grew by hundreds of MB
over hours until that cache filled (benchmarks/soak.py). Row counts above `EXACT_ROWS` are
therefore padded up to one of 16 sizes per power of two (`padded_rows`): the distinct shapes
stay bounded, all fit in the cache, and padding costs under 1/16 more rows.

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


# Decode batches (one row per sequence) run at their exact size.
EXACT_ROWS = 64


def padded_rows(rows: int) -> int:
    """Returns the row count a linear of `rows` input rows runs at: `rows` up to `EXACT_ROWS`,
    beyond that `rows` rounded up to a multiple of 1/16 of its power of two (< 1/16 more)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 5)
    return -(-rows // step) * step


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
        """Returns `x @ W.T + b` for `x` of shape (..., in_features); rows are padded to
        `padded_rows` for oneDNN and the padding's output is dropped."""
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        padded = padded_rows(rows)
        if padded != rows:
            flat = torch.nn.functional.pad(flat, (0, 0, 0, padded - rows))
        out = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, "none", [], "")
        return out[:rows].view(*x.shape[:-1], self.out_features)

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

