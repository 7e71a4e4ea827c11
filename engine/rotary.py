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
                     scaling: dict[str, Any] | None = None, long: bool = False) -> torch.Tensor:
    """Returns the float32 `[head_size // 2]` inverse frequencies, with rope scaling applied
    (for longrope: its short factors, or its long ones with `long`)."""
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_size
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "longrope":
        ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device="cpu")
        return 1.0 / (ext * theta ** exponents)
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, factor, float(scaling["low_freq_factor"]),
                                float(scaling["high_freq_factor"]),
                                float(scaling["original_max_position_embeddings"]))
    if kind == "yarn":
        return _yarn_inv_freq(head_size, theta, factor, scaling)
    raise ValueError(f"unsupported rope type {kind!r}")


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """Returns the factor cos and sin are multiplied by (1.0 but for yarn and longrope), as
    transformers' rope functions compute it."""
    if scaling is None or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "longrope":
        orig = float(scaling["original_max_position_embeddings"])
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim)))
    return _yarn_mscale(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(dim: int, base: float, factor: float, scaling: dict[str, Any]) -> torch.Tensor:
    # YaRN (Peng et al. 2023): frequencies that rotate fewer than beta_slow times over the
    # original context are interpolated (divided by `factor`), those rotating more than
    # beta_fast times kept, with a linear ramp between the two dimensions.
    orig = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero in the ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(torch.float32) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


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
                        dtype: torch.dtype, device: torch.device | str,
                        scale: float = 1.0) -> torch.Tensor:
    """Returns `[max_positions, head_size]`: cos of each angle in the first half, sin in the
    second, times `scale` (the rope's attention factor), computed in float32 then cast (as
    HF does)."""
    inv = inv_freq.to(device=device, dtype=torch.float32)
    pos = torch.arange(max_positions, device=device, dtype=torch.float32)
    angles = torch.outer(pos, inv)
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    return (table if scale == 1.0 else table * scale).to(dtype)


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
    models constructed on the meta device need no special handling.

    Longrope (Phi-3): positions below `original_max_position_embeddings` rotate with the short
    factors, later ones with the long factors. transformers picks the factors per forward by
    its longest position, which equals this per position while a prompt fits the original
    context (decoding past it switches exactly there); for a longer prompt it rotates the
    whole prompt with the long factors, which no KV cache can share with a shorter prompt's
    prefix, so the engine keeps KV a function of its position and differs there.
    """

    def __init__(self, head_size: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> None:
        self.head_size = head_size
        self.max_positions = max_positions
        self.inv_freq = compute_inv_freq(head_size, theta, scaling)
        self.attention_factor = attention_factor(scaling)
        self.long_inv_freq: torch.Tensor | None = None
        self.long_from = max_positions
        if scaling is not None and scaling["rope_type"] == "longrope":
            self.long_inv_freq = compute_inv_freq(head_size, theta, scaling, long=True)
            self.long_from = int(scaling["original_max_position_embeddings"])
        self._cache: torch.Tensor | None = None

    def cos_sin_cache(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Returns the `[max_positions, head_size]` table on `device` in `dtype`."""
        c = self._cache
        if c is None or c.device != device or c.dtype != dtype:
            c = build_cos_sin_cache(self.inv_freq, self.max_positions, dtype, device, self.attention_factor)
            if self.long_inv_freq is not None and self.long_from < self.max_positions:
                long = build_cos_sin_cache(self.long_inv_freq, self.max_positions, dtype, device,
                                           self.attention_factor)
                c[self.long_from:] = long[self.long_from:]
            self._cache = c
        return c
