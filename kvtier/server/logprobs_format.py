"""Logprobs in OpenAI's two wire shapes (vLLM's rendering), from the engine's per-position
`{token_id: Logprob}` dicts (own token first, then the top-k; engine/logprobs.py):

- completions (legacy): `{tokens, token_logprobs, top_logprobs, text_offset}`, where
  `top_logprobs[i]` maps up to k + 1 token strings (the own token and the top k) to logprobs;
- chat: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`,
  `top_logprobs` being the k most likely tokens in rank order;
- vLLM's `prompt_logprobs`: per prompt token None (the first) or `{id: {logprob, rank,
  decoded_token}}`.

JSON has no -inf: a logprob below -9999 is sent as -9999.0, as vLLM and OpenAI do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.outputs import LogprobsAtPosition

FLOOR = -9999.0


def clamp(logprob: float) -> float:
    """Returns `logprob`, or -9999.0 below that (-inf included)."""
    return max(logprob, FLOOR)


def token_text(tokenizer: Any, token_id: int, entry: LogprobsAtPosition | None) -> str:
    """Returns a token's text alone: the engine's decoded token, else a decode of the id."""
    lp = entry.get(token_id) if entry else None
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return str(tokenizer.decode([token_id]))


def completion_logprobs(tokenizer: Any, token_ids: Sequence[int], positions: Sequence[LogprobsAtPosition | None],
                        num_top: int, first_offset: int = 0) -> dict[str, Any]:
    """Returns the completions `logprobs` object for `token_ids` and their positions' entries
    (None: no logprob, e.g. an echoed first prompt token); `text_offset` counts characters of
    the token texts from `first_offset`."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = first_offset
    for tid, entry in zip(token_ids, positions, strict=True):
        text = token_text(tokenizer, tid, entry)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(clamp(entry[tid].logprob))
        top: dict[str, float] = {}
        for i, (t, lp) in enumerate(entry.items()):
            if i > num_top:
                break
            top[token_text(tokenizer, t, entry)] = clamp(lp.logprob)
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _chat_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": clamp(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}


def chat_logprobs(tokenizer: Any, token_ids: Sequence[int], positions: Sequence[LogprobsAtPosition],
                  num_top: int) -> dict[str, Any]:
    """Returns the chat `logprobs` object (`{"content": [...]}`) for generated `token_ids`."""
    content = []
    for tid, entry in zip(token_ids, positions, strict=True):
        item = _chat_entry(token_text(tokenizer, tid, entry), entry[tid].logprob)
        ranked = sorted((lp.rank or 0, t, lp.logprob) for t, lp in entry.items() if (lp.rank or 0) <= num_top)
        item["top_logprobs"] = [_chat_entry(token_text(tokenizer, t, entry), v) for _, t, v in ranked[:num_top]]
        content.append(item)
    return {"content": content}


def prompt_logprobs_json(positions: Sequence[LogprobsAtPosition | None] | None) -> list[Any] | None:
    """Returns vLLM's `prompt_logprobs` field for the engine's prompt logprobs (or None)."""
    if positions is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": clamp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in entry.items()}
            for entry in positions]
