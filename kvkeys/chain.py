"""The one chained-hash primitive: `h_i = blake2b-128(h_{i-1} || int64-le(tokens_i))`.

The engine's prefix cache (engine/block_pool.py) chains it over blocks from its own root, the
connector's keyspace (kvkeys/keyspace.py) over chunks from the chunk root. Python's `hash()`
is never used, so hashes are identical across processes, machines and PYTHONHASHSEED values.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

HASH_BYTES = 16


def root_hash(label: bytes) -> bytes:
    """Returns the fixed root a chain named `label` starts from."""
    return hashlib.blake2b(label, digest_size=HASH_BYTES).digest()


def token_bytes(tokens: Sequence[int] | np.ndarray | Any) -> bytes:
    """Returns `tokens` as little-endian int64 bytes; a torch tensor, numpy array or list of
    ints. Raises ValueError for anything but a one-dimensional sequence of integers."""
    if hasattr(tokens, "detach"):  # a torch tensor (the engine does not need torch here)
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    return arr.astype("<i8", copy=False).tobytes()


def chain_hash(parent: bytes, tokens: Sequence[int] | np.ndarray | Any) -> bytes:
    """Returns the 16-byte hash of `tokens` chained onto `parent`."""
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    h.update(token_bytes(tokens))
    return h.digest()


def chain_prefixes(parent: bytes, tokens: Sequence[int] | np.ndarray | Any) -> list[bytes]:
    """Returns, for m = 1 .. len(tokens), `chain_hash(parent, tokens[:m])` (entry m - 1), in
    one pass: blake2b is sequential, so each prefix costs one update and one copy."""
    raw = token_bytes(tokens)
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    out: list[bytes] = []
    for i in range(0, len(raw), 8):
        h.update(raw[i:i + 8])
        out.append(h.copy().digest())
    return out
