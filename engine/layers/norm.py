"""RMSNorm, with engine/cpu_ops.py's fused kernels for float32 rows on CPU."""

from __future__ import annotations

from types import ModuleType
from typing import cast

import torch
from torch import nn


class RMSNorm(nn.Module):
    # engine/cpu_ops.py's fused kernels (float32 rows on CPU), when the loader enabled them.
    cpu_ops: ModuleType | None = None

    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        # Gemma's flavour: scale by (1 + weight), computed in float32 before the cast back.
        self.unit_offset = unit_offset

    def _fused(self, x: torch.Tensor) -> bool:
        return (self.cpu_ops is not None and not self.unit_offset and x.dtype == torch.float32
                and x.dim() == 2 and x.is_contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns the normed `x` (any leading shape, normed over the last dim) in x's dtype."""
        if self._fused(x):
            return cast(torch.Tensor, self.cpu_ops.rms_norm(x, self.weight, self.eps))  # type: ignore[union-attr]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        # Normalise in float32 and scale in the input dtype, as HF does, so bf16 matches it.
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this norm of residual + x, residual + x); the fused kernel adds into
        `residual` in place (the caller's residual stream), the PyTorch path makes a new one."""
        if self._fused(x) and residual.is_contiguous():
            return self.cpu_ops.add_rms_norm(x, residual, self.weight, self.eps), residual  # type: ignore[union-attr]
        residual = residual + x
        return self(residual), residual
