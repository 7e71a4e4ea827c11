"""Segment keys and segment geometry for CacheBlend (pure functions).

A segment's K/V is stored at positions 0..n-1 (keys re-rotated there), whatever prompt it was
computed in, so it is keyed by its own tokens only: the chunk hash chain starts at a segment
root, not at the prompt prefix. Each way of computing it (`BlendConfig.segment_kv`) has its own
root, so the two never mix; prefix chains start at kvstore's `ROOT_HASH`, so a segment key can
never equal a prefix key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.keys import process_tokens

# BlendConfig.segment_kv -> the root its segment key chains start from.
SEGMENT_ROOTS = {
    "in_context": hashlib.blake2b(b"kvtier/blend-segment-root/in-context/v1", digest_size=16).hexdigest(),
    "standalone": hashlib.blake2b(b"kvtier/blend-segment-root/v1", digest_size=16).hexdigest(),
}

# (start, end, key) of one chunk, positions relative to the segment's first token.
Span = tuple[int, int, str]


@dataclass(frozen=True)
class Segment:
    """Segment `index` occupies prompt positions [start, end)."""

    index: int
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def segment_spans(tokens: Sequence[int], chunk_size: int, model: str, kv_dtype: str,
                  mode: str) -> list[Span]:
    """Returns the chunk spans of one segment keyed from the root of `mode` (a
    `BlendConfig.segment_kv`; the last span may be short); the keys depend on the segment's
    tokens and `mode` alone, never on its position."""
    return [(s, e, k.to_str()) for s, e, k in process_tokens(
        tokens, chunk_size, model=model, kv_dtype=kv_dtype, parent_hash=SEGMENT_ROOTS[mode], save_unfull_chunk=True)]


def context_segments(segment_lens: Sequence[int]) -> list[Segment]:
    """Returns every segment but the last (the query, always computed by the engine), in prompt
    order. Raises ValueError for a non-positive length."""
    out: list[Segment] = []
    pos = 0
    for i, n in enumerate(segment_lens):
        if n < 1:
            raise ValueError(f"segment {i} has {n} tokens")
        out.append(Segment(i, pos, pos + n))
        pos += n
    return out[:-1]

