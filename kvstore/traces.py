"""Request traces: the file format `kvtier cache plan` and `make bench-trace` read, and the
requests in it (kvstore/trace_replay.py replays them through the tiers). Stdlib only: reading
a trace, and `kvtier cache plan --help`, import no torch.

A trace is JSON Lines (optionally gzip-compressed), one request per line, in Mooncake's format
(kvcache-ai/Mooncake, FAST25-release/traces), taken as is:

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

`hash_ids` holds one id per `block_tokens` (512 in Mooncake's traces) prompt tokens, equal where
two prompts share the same tokens from the start up to the end of that block; `input_length`
is the prompt's length in tokens; `timestamp` (optional) orders arrivals; other fields are
ignored. A request's reusable prefix is the run of its blocks, from the first, that the tiers
hold when it arrives, as kvtier's connector looks a prompt up.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

BLOCK_TOKENS = 512
"""Tokens per hash id in Mooncake's traces."""


@dataclass(frozen=True)
class Request:
    """One request of a trace: its prompt length and one block id per `block_size` tokens of it."""

    input_length: int
    blocks: tuple[int, ...]
    block_size: int = BLOCK_TOKENS

    def block_tokens(self, i: int) -> int:
        """Returns the prompt tokens block `i` covers (the last block may be short)."""
        return max(0, min(self.block_size, self.input_length - i * self.block_size))


def read_trace(path: str | Path, block_tokens: int = BLOCK_TOKENS) -> list[Request]:
    """Returns the requests of the trace at `path` (JSON Lines, gzip if it ends in .gz), in
    arrival order (by `timestamp` where given; a stable sort). Raises ValueError naming the line
    and the field of the first malformed request."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    rows: list[tuple[float, Request]] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
            rows.append((_timestamp(row, path, n), _request(row, path, n, block_tokens)))
    rows.sort(key=lambda r: r[0])
    return [r for _, r in rows]


def _timestamp(row: object, path: Path, n: int) -> float:
    stamp = row.get("timestamp", 0) if isinstance(row, dict) else 0
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
        raise ValueError(f"{path}:{n}: timestamp must be a number, got {stamp!r}")
    return float(stamp)


def _request(row: object, path: Path, n: int, block_tokens: int) -> Request:
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{n}: expected a JSON object with input_length and hash_ids")
    length, ids = row.get("input_length"), row.get("hash_ids")
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"{path}:{n}: input_length must be a token count (an int >= 0), got {length!r}")
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
        raise ValueError(f"{path}:{n}: hash_ids must be a list of ints (one per {block_tokens} tokens)")
    if len(ids) * block_tokens < length or (ids and (len(ids) - 1) * block_tokens >= length):
        raise ValueError(f"{path}:{n}: {len(ids)} hash_ids do not cover input_length {length} in blocks of "
                         f"{block_tokens} tokens (--block-tokens)")
    return Request(length, tuple(ids), block_tokens)
