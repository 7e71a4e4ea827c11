"""Token sampling for a batch: greedy, temperature, top-k and top-p, vectorised over rows.

Random rows use the exponential-race trick (argmax of probs / Exp(1) noise equals a draw from
probs), so each row's noise can come from its own `torch.Generator`: a seeded request gives
the same tokens whatever it is batched with. Noise is drawn on the CPU so a seed means the
same thing on CPU and CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceT

import torch

from engine.sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Returns `logits` with tokens outside each row's top-k / top-p nucleus set to -inf.

    `top_k` [N] int64 (0 = off), `top_p` [N] float (1.0 = off). Ties at the boundary are kept
    in sort order; at least one token always survives.
    """
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    drop = ranks >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


class Sampler:
    """Samples one token per row; `generators[i]` (CPU) drives row i's randomness."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: SequenceT[SamplingParams],
        generators: SequenceT[torch.Generator | None],
    ) -> torch.Tensor:
        """Returns sampled token ids [N] (int64, on `logits`' device) for float logits [N, V]."""
        if logits.shape[0] != len(params):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(params)} sampling params")
        logits = logits.float()
        greedy_tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            return greedy_tokens
        dev = logits.device
        idx = torch.tensor(random_rows, device=dev)
        sub = logits.index_select(0, idx)
        rp = [params[i] for i in random_rows]
        temp = torch.tensor([p.temperature for p in rp], device=dev, dtype=torch.float32)
        sub = sub / temp.unsqueeze(1)
        top_k = torch.tensor([max(p.top_k, 0) for p in rp], device=dev, dtype=torch.long)
        top_p = torch.tensor([p.top_p for p in rp], device=dev, dtype=torch.float32)
        if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
            sub = apply_top_k_top_p(sub, top_k, top_p)
        probs = sub.softmax(dim=-1)
        # One noise row per request from its own generator (a loop over requests, not tokens).
        noise = torch.stack(
            [torch.empty(probs.shape[1]).exponential_(generator=generators[i]) for i in random_rows]
        ).clamp_(min=1e-20).to(dev)  # a zero draw would turn probs / noise into inf or nan
        sampled = (probs / noise).argmax(dim=-1)
        return greedy_tokens.index_copy(0, idx, sampled)
