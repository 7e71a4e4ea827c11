"""Attention with soft-capped scores (Gemma 2), in plain PyTorch.

Gemma 2 caps every attention score before the mask and softmax: `s = cap * tanh(s / cap)`
with `s = scale * q . k`. SDPA has no such hook, so these functions compute the scores
explicitly, as transformers' eager attention does (softmax in float32, probabilities cast
back to the query dtype). Prefill queries go in tiles of `_TILE` positions, so the scores
held at once are `heads x _TILE x keys`, never `heads x q_len x keys`.

engine/paged_attention.py routes a layer here when it has a cap; the compiled CPU decode
kernel (engine/csrc) caps its scores itself.
"""

from __future__ import annotations

import torch

# Query positions per tile of a capped prefill.
_TILE = 256


def softcap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """Returns `cap * tanh(scores / cap)`, in place on `scores`."""
    return scores.div_(cap).tanh_().mul_(cap)


def capped_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cap: float,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """Returns the attention output `[Hq, Lq, D]` of queries `q` `[Hq, Lq, D]` over keys and
    values `k`/`v` `[Hkv, Lk, D]` (Lk >= Lq; Hq a multiple of Hkv) with capped scores.

    The queries are the last Lq positions of the keys' sequence: query i sits at key index
    `Lk - Lq + i` and sees keys up to it (bottom-right causal). `mask` (additive
    `[Lq, Lk]`, e.g. a sliding window's) replaces that causal rule when given; it must block
    every key after its query. Keys after a tile's last query are never scored.
    """
    h_kv, l_k, d = k.shape
    h_q, l_q, _ = q.shape
    offset = l_k - l_q
    qg = q.view(h_kv, h_q // h_kv, l_q, d)
    out = torch.empty_like(q).view(h_kv, h_q // h_kv, l_q, d)
    for a in range(0, l_q, _TILE):
        b = min(a + _TILE, l_q)
        n = offset + b  # keys any query of this tile may see
        scores = softcap(torch.matmul(qg[:, :, a:b], k[:, None, :n].transpose(-1, -2)) * scale, cap)
        if mask is not None:
            scores = scores + mask[a:b, :n]
        else:
            q_pos = torch.arange(offset + a, offset + b, device=q.device).unsqueeze(1)
            future = torch.arange(n, device=q.device).unsqueeze(0) > q_pos
            scores = scores.masked_fill_(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[:, :, a:b] = torch.matmul(probs, v[:, None, :n])
    return out.view(h_q, l_q, d)


def capped_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cap: float,
                  mask: torch.Tensor | None) -> torch.Tensor:
    """Returns `[B, Hkv, G, D]`: decode queries `q` `[B, Hkv, G, D]` (the G query heads of each
    kv head) over keys and values `k`/`v` `[B, Hkv, n, D]` with capped scores and the additive
    key `mask` `[B, 1, 1, n]` (padding; None: every key counts)."""
    scores = softcap(torch.matmul(q, k.transpose(-1, -2)) * scale, cap)
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
