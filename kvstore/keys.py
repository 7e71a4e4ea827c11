"""Chunk keys and the chunked token database (docs/architecture.md, "Chunks, keys and codecs").

A key names everything that makes stored KV incompatible: model fingerprint, KV dtype,
layout version, chunk size, and the chained hash of the tokens up to and including the chunk:
`h_i = blake2b-128(h_{i-1} || int64-le(tokens_i))`, starting from a fixed root. Python's
`hash()` is never used, so keys are identical across processes, machines and PYTHONHASHSEED.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

LAYOUT_VERSION = 1
"""Bumped whenever the chunk tensor layout `(layers, 2, tokens, kv_heads, head_size)` changes."""

ROOT_HASH = hashlib.blake2b(b"kvtier/chunk-root/v1", digest_size=16).hexdigest()
"""The parent of a sequence's first chunk."""

TokenIds = Sequence[int] | np.ndarray | torch.Tensor


@dataclass(frozen=True)
class ChunkKey:
    """Identity of one stored chunk. `to_str()` is the backend key."""

    model: str
    kv_dtype: str
    layout_version: int
    chunk_size: int
    chunk_hash: str

    def __post_init__(self) -> None:
        for name in ("model", "kv_dtype", "chunk_hash"):
            value = getattr(self, name)
            if not isinstance(value, str) or ":" in value or any(c.isspace() for c in value):
                raise ValueError(f"ChunkKey.{name} must be a str without ':' or spaces, got {value!r}")

    def to_str(self) -> str:
        """Returns `kvtier:<model>:<dtype>:v<layout>:c<chunk_size>:<hash>` (no spaces, ASCII)."""
        return f"kvtier:{self.model}:{self.kv_dtype}:v{self.layout_version}:c{self.chunk_size}:{self.chunk_hash}"

    @classmethod
    def from_str(cls, text: str) -> ChunkKey:
        """Returns the key `to_str()` produced; raises ValueError for anything else."""
        parts = text.split(":")
        if len(parts) != 6 or parts[0] != "kvtier" or not parts[3].startswith("v") or not parts[4].startswith("c"):
            raise ValueError(f"not a kvtier chunk key: {text!r}")
        try:
            return cls(parts[1], parts[2], int(parts[3][1:]), int(parts[4][1:]), parts[5])
        except ValueError:
            raise ValueError(f"not a kvtier chunk key: {text!r}") from None


def dtype_name(dtype: torch.dtype | str) -> str:
    """Returns the short name of a KV dtype ("float16", "bfloat16", ...)."""
    return str(dtype).removeprefix("torch.")


def model_fingerprint(config: Mapping[str, Any], weights_id: str = "") -> str:
    """Returns a 16-hex-digit fingerprint of a model's architecture and weights identity.

    `config` is the model's config (e.g. HF config.json as a dict); `weights_id` identifies the
    weights (a checksum, file size + mtime, or a name+revision). Canonical JSON keeps it stable.
    """
    blob = json.dumps(dict(config), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.blake2b(f"{blob}\0{weights_id}".encode(), digest_size=8).hexdigest()


def _as_le_int64(tokens: TokenIds) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    return arr.astype("<i8", copy=False)


def chain_hash(parent_hash: str, tokens: TokenIds) -> str:
    """Returns the 128-bit hex hash of `tokens` chained onto `parent_hash`."""
    h = hashlib.blake2b(bytes.fromhex(parent_hash), digest_size=16)
    h.update(_as_le_int64(tokens).tobytes())
    return h.hexdigest()


def partial_chunk_keys(
    tokens: TokenIds,
    chunk_size: int,
    *,
    parent_hash: str,
    model: str = "",
    kv_dtype: torch.dtype | str = "",
    layout_version: int = LAYOUT_VERSION,
) -> list[ChunkKey]:
    """Returns, for m = 1 .. len(tokens) - 1, the key `tokens[:m]` has as a partial last chunk
    after `parent_hash` (entry m - 1): what `process_tokens` yields for a sequence ending there.
    A chunk that was stored partial, and later grew, is found again through these keys."""
    arr = _as_le_int64(tokens)
    dtype = dtype_name(kv_dtype)
    h = hashlib.blake2b(bytes.fromhex(parent_hash), digest_size=16)
    out: list[ChunkKey] = []
    raw = arr.tobytes()
    for m in range(1, arr.size):  # blake2b is sequential: one update per token, one copy per key
        h.update(raw[8 * (m - 1): 8 * m])
        out.append(ChunkKey(model, dtype, layout_version, chunk_size, h.copy().hexdigest()))
    return out


def process_tokens(
    tokens: TokenIds,
    chunk_size: int = 256,
    *,
    model: str = "",
    kv_dtype: torch.dtype | str = "",
    layout_version: int = LAYOUT_VERSION,
    parent_hash: str | None = None,
    save_unfull_chunk: bool = True,
) -> Iterator[tuple[int, int, ChunkKey]]:
    """Yields `(start, end, key)` for each `chunk_size` slice of `tokens`, keys chained over the prefix.

    The last partial chunk is yielded only if `save_unfull_chunk`. `parent_hash` (default the
    fixed root) lets a segment be keyed independently of what precedes it (CacheBlend).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    arr = _as_le_int64(tokens)
    prev = ROOT_HASH if parent_hash is None else parent_hash
    if len(prev) != 32:
        raise ValueError(f"parent_hash must be 32 hex digits, got {prev!r}")
    dtype = dtype_name(kv_dtype)
    for start in range(0, arr.size, chunk_size):
        end = min(start + chunk_size, arr.size)
        if end - start < chunk_size and not save_unfull_chunk:
            return
        prev = chain_hash(prev, arr[start:end])
        yield start, end, ChunkKey(model, dtype, layout_version, chunk_size, prev)
