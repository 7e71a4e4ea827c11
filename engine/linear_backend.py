"""The model's linear layers on oneDNN with prepacked weights, and where that runs.

On CPU, `F.linear` goes to MKL's sgemm, which on this project's AMD machine runs its generic
code path: oneDNN (shipped inside torch) with the weight reordered once into its blocked
layout is 2-3x faster at every batch size, from a 1-token decode to a 2k-token prefill
(`benchmarks/bench_kernels.py`, `bench_linear`). vLLM's CPU backend makes the same choice.
Results agree with `F.linear` to float rounding (a different summation order), not bit for bit.

oneDNN compiles and caches one primitive per distinct input row count, and torch's ideep layer
caches one computation per row count beside it, each with memory that grows with the rows and
each up to 1024 entries. A server sees every prompt length, so its RSS grew by hundreds of MB
over hours (benchmarks/soak.py). Two bounds: row counts above `EXACT_ROWS` are padded up to
one of 16 sizes per power of two (`padded_rows`, under 1/16 more rows), and `pack_linears`
caps both caches at `GEMM_CACHE_CAPACITY` entries. Compiling a GEMM costs ~0.4 ms, against
tens of ms for a step's 30 layers, so misses are cheap; 144 bucket sizes x 4 shapes cached
held ~340 MiB, the capped caches ~60 MiB.

The engine's `kernels="auto"` packs the linears where `onednn_supported` (CPU: fp32 always,
bf16 and fp16 where the CPU has the instructions); elsewhere (CUDA) they stay `nn.Linear`.
"""

from __future__ import annotations

import os

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


# Entries kept by oneDNN's primitive cache and by ideep's computation cache (both default 1024).
GEMM_CACHE_CAPACITY = 128
_CACHE_CAPACITY_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_gemm_caches() -> None:
    """Caps oneDNN's and ideep's GEMM caches at `GEMM_CACHE_CAPACITY` unless the environment
    already sets them. Both libraries read the cap at their first use in the process, so this
    takes effect only before the process's first oneDNN op (`pack_linears` calls it first)."""
    for var in _CACHE_CAPACITY_VARS:
        os.environ.setdefault(var, str(GEMM_CACHE_CAPACITY))


def pack_linears(module: nn.Module) -> int:
    """Replaces every `nn.Linear` under `module` by a PackedLinear of the same weights (the
    plain weights are then freed), after `bound_gemm_caches`; returns how many were replaced."""
    bound_gemm_caches()
    return _replace_linears(module)


def _replace_linears(module: nn.Module) -> int:
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias))
            count += 1
        else:
            count += _replace_linears(child)
    return count
