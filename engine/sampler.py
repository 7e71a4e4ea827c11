"""Token sampling for a batch, vectorised over rows, in vLLM's order: raw logprobs (if asked),
logits processors (allowed tokens, min_tokens, logit bias, penalties; engine/logits_processors.py),
then greedy argmax, or temperature, min_p, top-k and top-p and a draw.

Random rows use the exponential-race trick (argmax of probs / Exp(1) noise equals a draw from
probs), so each row's noise can come from its own `torch.Generator`: a seeded request gives
the same tokens whatever it is batched with. Noise is drawn on the CPU so a seed means the
same thing on CPU and CUDA. Logprobs are read off the raw logits and never feed back into
sampling: asking for them changes no token.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass

import torch

from engine.logits_processors import History, apply_allowed_and_bias, apply_min_p, apply_penalties
from engine.logprobs import TopLogprobs, gather_top_logprobs
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


@dataclass
class SamplerOutput:
    """Sampled token ids `[N]` (int64, on the logits' device), and for the rows that asked
    for logprobs (`logprob_rows`, in order) the sampled token's and the top ones (width:
    1 + the largest `logprobs` among them)."""

    token_ids: torch.Tensor
    logprob_rows: list[int]
    logprobs: TopLogprobs | None = None


class Sampler:
    """Samples one token per row; `generators[i]` (CPU) drives row i's randomness.
    `stop_token_ids` (the model's eos ids) are masked with a row's own stop_token_ids while
    it is short of `min_tokens`."""

    def __init__(self, stop_token_ids: Iterable[int] = ()) -> None:
        self.stop_token_ids = frozenset(stop_token_ids)

    def __call__(self, logits: torch.Tensor, params: SequenceT[SamplingParams],
                 generators: SequenceT[torch.Generator | None],
                 histories: SequenceT[History | None] | None = None) -> torch.Tensor:
        """Returns sampled token ids [N] (int64, on `logits`' device) for float logits [N, V]."""
        return self.sample(logits, params, generators, histories).token_ids

    def sample(self, logits: torch.Tensor, params: SequenceT[SamplingParams],
               generators: SequenceT[torch.Generator | None],
               histories: SequenceT[History | None] | None = None) -> SamplerOutput:
        """Returns the sampled tokens and the asked-for logprobs of float logits [N, V].
        `histories[i]` (prompt ids, output ids) is needed by rows with penalties or min_tokens."""
        if logits.shape[0] != len(params):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(params)} sampling params")
        logits = logits.float()
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = None
        if lp_rows:
            raw = torch.log_softmax(logits if len(lp_rows) == len(params) else logits[lp_rows], dim=-1)
        if any(p.allowed_token_ids is not None or p.logit_bias or p.uses_history for p in params):
            hist = list(histories) if histories is not None else [None] * len(params)
            logits = apply_allowed_and_bias(logits.clone(), params, hist, self.stop_token_ids)
            logits = apply_penalties(logits, params, hist)
        tokens = self._draw(logits, params, generators)
        out = SamplerOutput(tokens, lp_rows)
        if raw is not None:
            k = max(params[i].logprobs or 0 for i in lp_rows)
            own = tokens if len(lp_rows) == len(params) else tokens[lp_rows]
            out.logprobs = gather_top_logprobs(raw, k, own)
        return out

    @staticmethod
    def _draw(logits: torch.Tensor, params: SequenceT[SamplingParams],
              generators: SequenceT[torch.Generator | None]) -> torch.Tensor:
        """Returns the greedy token of greedy rows and a draw for the others."""
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
        if any(p.min_p > 0.0 for p in rp):
            sub = apply_min_p(sub, torch.tensor([p.min_p for p in rp], device=dev, dtype=torch.float32))
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
