"""The per-request changes to a batch of logits before sampling, in vLLM's order and meaning.

Each function takes float32 logits `[N, V]` (one row per request) and the rows' params, and
changes only the rows whose params ask for it, vectorised over those rows:
`apply_allowed_and_bias` (allowed_token_ids, min_tokens, logit_bias), `apply_penalties`
(repetition, frequency, presence) and, after temperature, `apply_min_p`. Rows that ask for
nothing are left bit-for-bit unchanged, so a greedy request's token does not depend on what
its batch neighbours ask for.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling_params import SamplingParams

# (prompt token ids, output token ids) of one request.
History = tuple[Sequence[int], Sequence[int]]


def apply_allowed_and_bias(logits: torch.Tensor, params: Sequence[SamplingParams],
                           histories: Sequence[History | None], stop_ids: frozenset[int]) -> torch.Tensor:
    """Returns `logits` (changed in place) with tokens outside `allowed_token_ids` at -inf,
    eos and `stop_token_ids` (`stop_ids` plus the row's own) at -inf while the row has fewer
    than `min_tokens` output tokens, and `logit_bias` added."""
    neg_inf = float("-inf")
    for i, p in enumerate(params):
        if p.allowed_token_ids is not None:
            keep = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
            keep[torch.tensor(p.allowed_token_ids, device=logits.device)] = True
            logits[i].masked_fill_(~keep, neg_inf)
        if p.min_tokens > 0:
            hist = histories[i]
            if hist is None:
                raise ValueError("min_tokens needs the request's output tokens")
            if len(hist[1]) < p.min_tokens:
                ids = sorted(stop_ids | set(p.stop_token_ids))
                if ids:
                    logits[i, torch.tensor(ids, device=logits.device)] = neg_inf
        if p.logit_bias:
            ids_t = torch.tensor(list(p.logit_bias), device=logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), device=logits.device, dtype=logits.dtype)
            logits[i].index_add_(0, ids_t, bias)
    return logits


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Returns int64 `[len(token_lists), vocab]`: how often each token occurs in each list."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), width + 1), vocab, dtype=torch.long)  # `vocab` = padding
    for i, toks in enumerate(token_lists):
        if toks:
            padded[i, : len(toks)] = torch.as_tensor(list(toks), dtype=torch.long)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.long)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab].to(device)


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    histories: Sequence[History | None]) -> torch.Tensor:
    """Returns `logits` (changed in place) with each row's penalties applied (vLLM's formulas):
    a token in the prompt or the output has a positive logit divided by
    `repetition_penalty` and a negative one multiplied by it; then the logit loses
    `frequency_penalty` x its count in the output and `presence_penalty` if it occurs there."""
    rows = [i for i, p in enumerate(params)
            if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if not rows:
        return logits
    hist = [histories[i] for i in rows]
    if any(h is None for h in hist):
        raise ValueError("penalties need the request's prompt and output tokens")
    vocab, dev = logits.shape[1], logits.device
    sub = logits[rows]
    outputs = _token_counts([h[1] for h in hist if h is not None], vocab, dev)
    in_output = outputs > 0
    rp = [params[i].repetition_penalty for i in rows]
    if any(r != 1.0 for r in rp):
        in_prompt = _token_counts([h[0] for h in hist if h is not None], vocab, dev) > 0
        pen = torch.tensor(rp, dtype=sub.dtype, device=dev).unsqueeze(1)
        pen = torch.where(in_prompt | in_output, pen, torch.ones_like(pen))
        sub = torch.where(sub > 0, sub / pen, sub * pen)
    freq = torch.tensor([params[i].frequency_penalty for i in rows], dtype=sub.dtype, device=dev)
    pres = torch.tensor([params[i].presence_penalty for i in rows], dtype=sub.dtype, device=dev)
    sub = sub - freq.unsqueeze(1) * outputs.to(sub.dtype) - pres.unsqueeze(1) * in_output.to(sub.dtype)
    logits[rows] = sub
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Returns `logits` with tokens whose probability is below `min_p` x the row's highest
    probability set to -inf (`min_p` [N], 0 = off); the most likely token always survives."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))
