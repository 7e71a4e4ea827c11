"""Segment geometry for CacheBlend (pure functions) and `BlendSpec`, one blend's plan as it
crosses to the worker side. Segment keys come from the keyspace (`Keyspace.segment_spans`):
a segment is keyed by its own tokens only, wherever it appears."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """Segment `index` occupies prompt positions [start, end)."""

    index: int
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


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


@dataclass
class BlendSpec:
    """Blend positions [start, end) of a segmented request (start: the engine's prefix-cache
    hit) from its context `segments`; positions [0, exact_end) come out exact (the engine's
    hit, the first segment, and segments computed in this prompt)."""

    request_id: str
    start: int
    end: int
    segments: list[Segment]
    exact_end: int
    token_ids: list[int]
    block_ids: list[int]
    cache_salt: str | None = None  # the request's: its segments are keyed in its keyspace
