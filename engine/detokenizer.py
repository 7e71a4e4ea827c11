"""Incremental detokenization and stop strings (vLLM's incremental detokenizer, in small).

Decoding a request's whole output after every step costs O(n) per token; here each step
decodes only a short window: the tokens since the last emitted text plus the few before them
(`prefix_offset`), so tokenizers whose decode depends on context (leading-space rules, bytes
split across tokens) give the same text as one full decode. A window that ends inside a
multi-byte character decodes to U+FFFD and is held back until the character completes.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """One request's output text, extended token by token. Not thread-safe (the engine's)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self.prefix_offset = 0  # window start: decoded for context only
        self.read_offset = 0  # tokens before this are in `text`

    def update(self, token_ids: list[int], final: bool = False) -> str:
        """Appends the text of `token_ids[read_offset:]` (the whole output so far) to `text`;
        returns the new part ("" while a character is incomplete, unless `final`)."""
        decode = self.tokenizer.decode
        prefix = decode(token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special_tokens)
        full = decode(token_ids[self.prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        new = full[len(prefix):]
        self.text += new
        self.prefix_offset = self.read_offset
        self.read_offset = len(token_ids)
        return new


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """Returns (position, stop string) of the earliest stop string that ends in the last
    `num_new_chars` characters of `text`, or None. Earlier text was checked on earlier calls."""
    if not stops or num_new_chars <= 0:
        return None
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        i = text.find(stop, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best
