"""Logprobs of the raw model distribution: gathered from logits in tensors, turned into
vLLM's per-position `{token_id: Logprob}` dicts, and recorded on the sequences they belong to.

Raw means log_softmax of the model's logits before penalties, bias, temperature and
filtering (vLLM's default `logprobs_mode="raw_logprobs"`): what the model thinks, not what
the sampler drew from. Rank r of a token is the number of tokens whose logprob is >= its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.outputs import Logprob, LogprobsAtPosition
from engine.sequence import Sequence

# Logit rows computed at once for prompt logprobs: 256 x vocab 49152 x fp32 is 48 MiB.
PROMPT_LOGITS_TILE_ROWS = 256


@dataclass
class TopLogprobs:
    """Per row: `token_ids[:, 0]` is the row's own token (sampled, or the next prompt
    token), `token_ids[:, 1:]` the row's top-k in rank order; `logprobs` theirs; `ranks` the
    own token's rank. CPU tensors."""

    token_ids: torch.Tensor  # int64 [R, 1 + k]
    logprobs: torch.Tensor  # float32 [R, 1 + k]
    ranks: torch.Tensor  # int64 [R]


def gather_top_logprobs(logprobs: torch.Tensor, k: int, token_ids: torch.Tensor) -> TopLogprobs:
    """Returns the own token's logprob and rank and the top-`k` of each row of `logprobs`
    `[R, V]` (a log_softmax) for own tokens `token_ids` `[R]`."""
    own = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs >= own).sum(dim=1)
    top_lp, top_ids = logprobs.topk(k, dim=1) if k > 0 else (logprobs[:, :0], token_ids[:, None][:, :0])
    return TopLogprobs(torch.cat([token_ids.unsqueeze(1), top_ids], 1).cpu(),
                       torch.cat([own, top_lp], 1).float().cpu(), ranks.cpu())


def prompt_top_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                        next_ids: torch.Tensor, k: int, tile: int = PROMPT_LOGITS_TILE_ROWS) -> TopLogprobs:
    """Returns `gather_top_logprobs` of the model's raw distribution at each row of `hidden`
    `[R, H]` (prompt positions) for the prompt tokens that follow them, `next_ids` `[R]`;
    logits are computed `tile` rows at a time, so memory stays `tile x vocab`."""
    parts = [gather_top_logprobs(torch.log_softmax(compute_logits(hidden[s:s + tile]).float(), dim=-1), k,
                                 next_ids[s:s + tile])
             for s in range(0, hidden.shape[0], tile)]
    return TopLogprobs(torch.cat([p.token_ids for p in parts]), torch.cat([p.logprobs for p in parts]),
                       torch.cat([p.ranks for p in parts]))


@dataclass
class PromptLogprobsChunk:
    """Prompt logprobs of one request computed in one step: rows predict the prompt tokens
    at positions `first + 1 ...`."""

    first: int
    top: TopLogprobs
    k: int


@dataclass
class StepLogprobs:
    """What a step computed about probabilities, by index in `SchedulerOutput.requests`:
    the sampled token's logprobs (requests with `logprobs` set) and prompt logprobs chunks."""

    sampled: dict[int, tuple[TopLogprobs, int, int]] = field(default_factory=dict)  # -> (top, row, k)
    prompt: dict[int, PromptLogprobsChunk] = field(default_factory=dict)


class TokenDecoder:
    """Each token's text alone (`decode([id])`, as vLLM's Logprob.decoded_token), cached."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = str(self._tokenizer.decode([token_id]))
        return text


def position_dict(ids: Iterable[int], lps: Iterable[float], rank: int, decode: TokenDecoder) -> LogprobsAtPosition:
    """Returns one position's `{token_id: Logprob}`: the own token first (its rank), then the
    top-k with ranks 1..k (a top token that is also the own token keeps one entry)."""
    out: LogprobsAtPosition = {}
    for j, (tid, lp) in enumerate(zip(ids, lps)):
        out[tid] = Logprob(lp, rank if j == 0 else j, decode(tid))
    return out


def record_step_logprobs(requests: list[Any], step: StepLogprobs, decode: TokenDecoder) -> None:
    """Stores a step's logprobs on its sequences (`requests[i].seq`): prompt chunks by
    position (a recomputed chunk overwrites the same values), and the sampled token's entry
    when the step appended that token (`len(seq.logprobs)` stays `num_output_tokens`)."""
    for i, chunk in step.prompt.items():
        seq: Sequence = requests[i].seq
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None] * seq.num_prompt_tokens
        width = 1 + chunk.k
        ids, lps = chunk.top.token_ids[:, :width].tolist(), chunk.top.logprobs[:, :width].tolist()
        ranks = chunk.top.ranks.tolist()
        for r in range(len(ids)):
            seq.prompt_logprobs[chunk.first + 1 + r] = position_dict(ids[r], lps[r], ranks[r], decode)
    for i, (top, row, k) in step.sampled.items():
        seq = requests[i].seq
        if seq.logprobs is None:
            seq.logprobs = []
        if seq.num_output_tokens != len(seq.logprobs) + 1:
            continue  # the step's token was discarded (a failed load) or none was appended
        entry = position_dict(top.token_ids[row, : 1 + k].tolist(), top.logprobs[row, : 1 + k].tolist(),
                              int(top.ranks[row]), decode)
        seq.logprobs.append(entry)
        seq.cumulative_logprob += float(top.logprobs[row, 0])
