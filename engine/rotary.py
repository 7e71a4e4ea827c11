"""Rotary position embeddings (RoPE, neox/"rotate half" layout as in HF Llama).

Pure functions so that CacheBlend can re-rotate cached keys: RoPE rotations compose
additively, R(p_new) = R(p_new - p_old) R(p_old), so `rerotate(k, old, new, inv_freq)` moves
keys computed at `old` positions to `new` ones without recomputing them.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def compute_inv_freq(head_size: int, theta: float,
                     scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Returns the float32 `[head_size // 2]` inverse frequencies, with rope scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.int64, device="cpu")
                                .to(torch.float32) / head_size))
    if scaling is None:
        return inv_freq
    kind, factor = scaling["rope_type"], float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, factor, float(scaling["low_freq_factor"]),
                                float(scaling["high_freq_factor"]),
                                float(scaling["original_max_position_embeddings"]))
    raise ValueError(f"unsupported rope type {kind!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low: float, high: float,
                     old_len: float) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly.
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low, old_len / high
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def build_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int,
                        dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Returns `[max_positions, head_size]`: cos of each angle in the first half, sin in the
    second, computed in float32 then cast (as HF does)."""
    inv = inv_freq.to(device=device, dtype=torch.float32)
    pos = torch.arange(max_positions, device=device, dtype=torch.float32)
    angles = torch.outer(pos, inv)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Rotates `x` `[T, H, D]` to `positions` `[T]`; returns a new tensor of x's dtype."""
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(-2).chunk(2, dim=-1)
    return _rotate(x, cos.to(x.dtype), sin.to(x.dtype))


def rerotate(k: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor,
             inv_freq: torch.Tensor) -> torch.Tensor:
    """Moves post-RoPE keys `[T, H, D]` from `old_positions` to `new_positions` (any sign of
    shift); returns a new tensor of k's dtype. Angles are computed in float32."""
    delta = (new_positions - old_positions).to(torch.float32)
    angles = torch.outer(delta, inv_freq.to(device=k.device, dtype=torch.float32)).unsqueeze(-2)
    return _rotate(k.float(), angles.cos(), angles.sin()).to(k.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RotaryEmbedding:
    """Holds the cos/sin table for one model; built lazily on first use per device/dtype so
    models constructed on the meta device need no special handling."""

    def __init__(self, head_size: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> None:
        self.head_size = head_size
        self.max_positions = max_positions
        self.inv_freq = compute_inv_freq(head_size, theta, scaling)
        self._cache: torch.Tensor | None = None

    def cos_sin_cache(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Returns the `[max_positions, head_size]` table on `device` in `dtype`."""
        c = self._cache
        if c is None or c.device != device or c.dtype != dtype:
            c = self._cache = build_cos_sin_cache(self.inv_freq, self.max_positions, dtype, device)
        return c
