"""The model's linear layers on CPU, with weights packed once at load, and which runs where.

On CPU, `F.linear` goes to MKL's sgemm, which on this project's AMD machine runs its generic
code path. Two packed forms replace it (`benchmarks/bench_kernels.py`, `bench_linear`):
- float32: `PanelLinear`, kvtier's kernel (engine/csrc/panel_linear.cpp) over the weight cut
  into panels of 16 output columns. A decode step is a few rows against every weight, so it is
  bound by reading them: each panel is one contiguous stream, which reads faster than oneDNN's
  GEMV over its blocked layout; a prefill's GEMM runs at oneDNN's rate.
- bfloat16/float16, or float32 where the kernels cannot be built: `PackedLinear`, oneDNN
  (shipped inside torch) with the weight reordered once into its blocked layout, faster than
  `F.linear` at every row count. vLLM's CPU backend makes this choice.
Results agree with `F.linear` to float rounding (a different summation order), not bit for bit.

oneDNN compiles and caches one primitive per distinct input row count, and torch's ideep layer
caches one computation per row count beside it, each with memory that grows with the rows and
each up to 1024 entries. A server sees every prompt length, so its RSS grew steadily over
hours (benchmarks/soak.py). Two bounds: row counts above `EXACT_ROWS` are padded up to
one of 16 sizes per power of two (`padded_rows`, under 1/16 more rows), and `pack_linears`
caps both caches at `GEMM_CACHE_CAPACITY` entries. A GEMM compiles in a small fraction of a
step's 30 layers, so misses are cheap, and the capped caches hold a fraction of what every
bucket size cached held (docs/reliability.md, "The soak").

The engine's `kernels="auto"` packs the linears with `linear_packer`: panels for float32 on
CPU with the kernels built, else oneDNN where `onednn_supported` (CPU: fp32 always, bf16 and
fp16 where the CPU has the instructions); elsewhere (CUDA) they stay `nn.Linear`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

# Builds the packed module of one linear from its (weight [out, in], bias or None).
LinearPacker = Callable[[torch.Tensor, "torch.Tensor | None"], nn.Module]

# Output columns per panel (the kernel's vector of 16 floats).
PANEL_COLUMNS = 16


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


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """Returns `weight` [out, in] as contiguous panels [ceil(out / 16), in, 16]: panel p holds
    output columns 16p..16p+15 (zeros past `out`), each input feature's 16 weights together."""
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL_COLUMNS)
    padded = weight.detach()
    if out_features % PANEL_COLUMNS:  # a pad copies the whole weight: only where columns are missing
        padded = F.pad(padded, (0, 0, 0, panels * PANEL_COLUMNS - out_features))
    return padded.reshape(panels, PANEL_COLUMNS, in_features).transpose(1, 2).contiguous()


class PanelLinear(nn.Module):
    """`y = x @ W.T + b` in float32 through kvtier's panel kernel (engine/csrc/panel_linear.cpp),
    with W held only as `to_panels(W)` and b padded to the panels' columns."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops: ModuleType) -> None:
        super().__init__()
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"the panel kernel runs float32 on CPU, got {weight.dtype} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.panels = to_panels(weight)
        self.bias = None if bias is None else F.pad(bias.detach(), (0, self.panels.shape[0] * PANEL_COLUMNS
                                                                    - self.out_features)).contiguous()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns `x @ W.T + b` for float32 `x` of shape (..., in_features), contiguous."""
        flat = x.reshape(-1, self.in_features)
        out = self.ops.panel_linear(flat.contiguous(), self.panels, self.bias, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, panels"


def linear_packer(device: torch.device, dtype: torch.dtype, ops: ModuleType | None) -> LinearPacker | None:
    """Returns how `kernels="auto"` packs a model's linears on `device` in `dtype`: panels for
    float32 on CPU where `ops` (engine/cpu_ops.py's kernels) are built, else oneDNN where it
    runs; None: they stay `nn.Linear`."""
    if device.type == "cpu" and dtype == torch.float32 and ops is not None:
        return functools.partial(PanelLinear, ops=ops)
    if onednn_supported(device, dtype):
        return PackedLinear
    return None


# Entries kept by oneDNN's primitive cache and by ideep's computation cache (both default 1024).
GEMM_CACHE_CAPACITY = 128
_CACHE_CAPACITY_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_gemm_caches() -> None:
    """Caps oneDNN's and ideep's GEMM caches at `GEMM_CACHE_CAPACITY` unless the environment
    already sets them. Both libraries read the cap at their first use in the process, so this
    takes effect only before the process's first oneDNN op (`pack_linears` calls it first)."""
    for var in _CACHE_CAPACITY_VARS:
        os.environ.setdefault(var, str(GEMM_CACHE_CAPACITY))


def pack_linears(module: nn.Module, packer: LinearPacker = PackedLinear) -> int:
    """Replaces every `nn.Linear` under `module` by `packer(weight, bias)` (the plain weights
    are then freed), after `bound_gemm_caches`; returns how many were replaced."""
    bound_gemm_caches()
    return _replace_linears(module, packer)


def _replace_linears(module: nn.Module, packer: LinearPacker) -> int:
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, packer(child.weight, child.bias))
            count += 1
        else:
            count += _replace_linears(child, packer)
    return count
