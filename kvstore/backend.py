"""The one storage-backend interface every tier implements (DESIGN §4).

Keys are strings (`ChunkKey.to_str()`), identical across processes and machines. Values are
KV chunk tensors `(num_layers, 2, num_tokens, num_kv_heads, head_size)`. Memory tiers hold
tensors; tiers that store bytes (disk, redis, the cache server) derive from `BytesBackend`,
which frames each chunk as one self-describing value through `kvstore.serde` so that a
corrupted, truncated or foreign value is a miss (None), never KV.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class BackendError(RuntimeError):
    """A tier failed (connection refused, disk full, ...). The storage manager catches it,
    marks the tier unhealthy and retries later; it never reaches the engine."""


@dataclass
class BackendStats:
    """Counters a backend reports; the storage manager aggregates them per tier."""

    entries: int = 0
    bytes_used: int = 0
    byte_budget: int | None = None
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    corrupt: int = 0
    errors: int = 0


class StorageBackend(ABC):
    """A tier. Every method may raise BackendError on an I/O failure; none returns wrong data."""

    name: str = "backend"

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Returns whether `key` is stored (a later get may still miss if it is evicted)."""

    def prefix_hits(self, keys: Sequence[str]) -> int:
        """Returns how many of `keys`, counted from the start, are stored."""
        n = 0
        for key in keys:
            if not self.contains(key):
                break
            n += 1
        return n

    @abstractmethod
    def get(self, key: str) -> torch.Tensor | None:
        """Returns the chunk stored under `key`, or None on a miss or a corrupt value."""

    def batched_get(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        """Returns one result per key, in order (None for each miss)."""
        return [self.get(k) for k in keys]

    @abstractmethod
    def put(self, key: str, kv: torch.Tensor) -> None:
        """Stores `kv` under `key`, evicting as needed to stay within the byte budget."""

    def batched_put(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        for key, kv in items:
            self.put(key, kv)

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Removes `key`; returns whether it was present."""

    @abstractmethod
    def clear(self) -> None:
        """Removes every chunk this backend owns."""

    @abstractmethod
    def stats(self) -> BackendStats: ...

    def close(self) -> None:
        """Releases connections and files; the backend is unusable afterwards."""
