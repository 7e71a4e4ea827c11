"""The two caches the simulator tracks: an engine's paged prefix cache and a byte-budgeted tier."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


class BlockPool:
    """An engine's KV pool of `capacity` blocks with prefix caching, as vLLM v1 keeps it:
    blocks held by running requests are pinned by a ref count; freed blocks stay cached and are
    evicted least recently freed first (a request's tail blocks before its head)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._refs: dict[Hashable, int] = {}
        self._free: OrderedDict[Hashable, None] = OrderedDict()  # cached, unreferenced; LRU first

    @property
    def num_held(self) -> int:
        return len(self._refs)

    def num_available(self) -> int:
        """Returns how many blocks a new request could take (empty ones plus evictable cached ones)."""
        return self.capacity - len(self._refs)

    def hit_blocks(self, keys: Sequence[Hashable]) -> int:
        """Returns the number of leading `keys` the pool holds (held or cached)."""
        n = 0
        for k in keys:
            if k not in self._refs and k not in self._free:
                break
            n += 1
        return n

    def acquire(self, keys: Sequence[Hashable]) -> bool:
        """Takes a reference on every key, evicting cached blocks for the missing ones.

        Returns False (and changes nothing) when the missing blocks do not fit."""
        missing = sum(1 for k in dict.fromkeys(keys) if k not in self._refs and k not in self._free)
        reusable = sum(1 for k in dict.fromkeys(keys) if k in self._free)
        if missing + reusable > self.num_available():
            return False
        for k in keys:
            if k in self._refs:
                self._refs[k] += 1
                continue
            self._free.pop(k, None)
            while len(self._refs) + len(self._free) >= self.capacity:
                self._free.popitem(last=False)
            self._refs[k] = 1
        return True

    def commit(self, placeholders: Sequence[Hashable], keys: Sequence[Hashable]) -> list[Hashable]:
        """Names computed blocks: each held placeholder takes its real key, so later requests
        hit it; a key the pool already holds (computed twice at once) keeps the placeholder as
        a duplicate block. Returns the keys now held, in order."""
        held: list[Hashable] = []
        for ph, k in zip(placeholders, keys, strict=True):
            if k in self._refs or k in self._free:
                held.append(ph)
                continue
            del self._refs[ph]
            self._refs[k] = 1
            held.append(k)
        return held

    def release(self, keys: Sequence[Hashable]) -> None:
        """Drops one reference per key; unreferenced blocks become cached, tail first in line to go."""
        for k in reversed(keys):
            left = self._refs[k] - 1
            if left:
                self._refs[k] = left
            else:
                del self._refs[k]
                self._free[k] = None


class ChunkTier:
    """One storage tier: chunks of `chunk_bytes` each under an exact byte budget, LRU."""

    def __init__(self, name: str, budget_bytes: int, chunk_bytes: int, load_gbps: float, latency_s: float) -> None:
        self.name = name
        self.budget_bytes = budget_bytes
        self.chunk_bytes = chunk_bytes
        self.load_gbps = load_gbps
        self.latency_s = latency_s
        self._chunks: OrderedDict[Hashable, None] = OrderedDict()
        self.bytes_stored = 0  # written over the run
        self.bytes_loaded = 0
        self.lookups = 0
        self.gets = 0
        self.puts = 0

    @property
    def max_chunks(self) -> int:
        return self.budget_bytes // self.chunk_bytes

    @property
    def bytes_used(self) -> int:
        return len(self._chunks) * self.chunk_bytes

    def __contains__(self, key: Hashable) -> bool:
        return key in self._chunks

    def put(self, key: Hashable) -> None:
        """Stores a chunk (a chunk already held is only refreshed), evicting LRU past the budget."""
        if key in self._chunks:
            self._chunks.move_to_end(key)
            return
        if self.max_chunks == 0:
            return
        while len(self._chunks) >= self.max_chunks:
            self._chunks.popitem(last=False)
        self._chunks[key] = None
        self.bytes_stored += self.chunk_bytes
        self.puts += 1

    def get(self, key: Hashable) -> float:
        """Marks a chunk used; returns the seconds its load takes from this tier."""
        self._chunks.move_to_end(key)
        self.bytes_loaded += self.chunk_bytes
        self.gets += 1
        return self.chunk_bytes / (self.load_gbps * 1e9)
