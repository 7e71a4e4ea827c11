"""The cache server's in-memory LRU byte store, with optional spill to disk.

Values are opaque bytes; the server never decodes them. The memory budget counts
`len(key) + len(value)` of every entry and is never exceeded: a put evicts least recently
used entries first (to the disk spill when there is one) and a value that cannot fit at
all is refused. Memory and disk hold disjoint sets of keys: a GET that finds its key on
disk moves it back into memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvstore.server.disk import DiskSpill
from kvstore.server.protocol import Buffer


@dataclass
class StoreStats:
    """What STATS reports (as JSON)."""

    entries: int
    bytes: int
    max_bytes: int
    hits: int
    misses: int
    puts: int
    evictions: int
    rejected: int
    disk_entries: int
    disk_bytes: int
    max_disk_bytes: int
    disk_hits: int
    disk_evictions: int
    disk_corrupt: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class ByteStore:
    """LRU map of byte keys to byte values within `max_bytes`. Not thread-safe: the server
    touches it only from its event loop thread."""

    def __init__(self, max_bytes: int, spill: DiskSpill | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self.spill = spill
        self.bytes_used = 0
        self.hits = self.misses = self.puts = self.evictions = self.rejected = 0
        self.disk_hits = 0
        self._lru: OrderedDict[bytes, Buffer] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._lru) + (len(self.spill) if self.spill is not None else 0)

    def fits(self, key_len: int, value_len: int) -> bool:
        """Returns whether an entry of these sizes can be stored in memory at all."""
        return key_len + value_len <= self.max_bytes

    def put(self, key: bytes, value: Buffer) -> bool:
        """Stores `value` (kept by reference, not copied); returns False if it can never fit.
        Guarantees bytes_used <= max_bytes afterwards."""
        size = len(key) + len(value)
        self._remove(key)
        if self.spill is not None:
            self.spill.delete(key)  # memory and disk hold disjoint keys
        if size > self.max_bytes:
            self.rejected += 1
            return False
        self._evict_to(self.max_bytes - size)
        self._lru[key] = value
        self.bytes_used += size
        self.puts += 1
        return True

    def get(self, key: bytes) -> Buffer | None:
        """Returns the value (promoted to most recently used, and into memory from disk),
        or None on a miss."""
        value = self._lru.get(key)
        if value is not None:
            self._lru.move_to_end(key)
            self.hits += 1
            return value
        if self.spill is not None and key in self.spill:
            value = self.spill.get(key)
            if value is not None:
                self.spill.delete(key)
                self.hits += 1
                self.disk_hits += 1
                if self.fits(len(key), len(value)):
                    self._evict_to(self.max_bytes - len(key) - len(value))
                    self._lru[key] = value
                    self.bytes_used += len(key) + len(value)
                return value
        self.misses += 1
        return None

    def contains(self, key: bytes) -> bool:
        """Returns whether `key` is held in memory or on disk (touches no LRU order)."""
        return key in self._lru or (self.spill is not None and key in self.spill)

    def prefix_hits(self, keys: Sequence[bytes]) -> int:
        """Returns how many of `keys`, counted from the start, are held."""
        n = 0
        for key in keys:
            if not self.contains(key):
                break
            n += 1
        return n

    def delete(self, key: bytes) -> bool:
        """Removes `key` from memory and disk; returns whether it was present."""
        in_memory = self._remove(key)
        on_disk = self.spill.delete(key) if self.spill is not None else False
        return in_memory or on_disk

    def clear(self) -> None:
        self._lru.clear()
        self.bytes_used = 0
        if self.spill is not None:
            self.spill.clear()

    def flush_to_disk(self) -> int:
        """Writes every in-memory entry to the disk spill (most recent last, so that the
        disk LRU keeps the hottest); returns how many were written. Used at shutdown so a
        restart with the same --disk keeps the data."""
        if self.spill is None:
            return 0
        written = 0
        for key, value in self._lru.items():
            written += self.spill.put(key, value)
        return written

    def stats(self) -> StoreStats:
        spill = self.spill
        return StoreStats(
            entries=len(self._lru),
            bytes=self.bytes_used,
            max_bytes=self.max_bytes,
            hits=self.hits,
            misses=self.misses,
            puts=self.puts,
            evictions=self.evictions,
            rejected=self.rejected,
            disk_entries=len(spill) if spill is not None else 0,
            disk_bytes=spill.bytes_used if spill is not None else 0,
            max_disk_bytes=spill.max_bytes if spill is not None else 0,
            disk_hits=self.disk_hits,
            disk_evictions=spill.evictions if spill is not None else 0,
            disk_corrupt=spill.corrupt if spill is not None else 0,
        )

    def _remove(self, key: bytes) -> bool:
        value = self._lru.pop(key, None)
        if value is None:
            return False
        self.bytes_used -= len(key) + len(value)
        return True

    def _evict_to(self, limit: int) -> None:
        # Evicted entries go to disk when a spill exists; otherwise they are dropped.
        while self.bytes_used > limit and self._lru:
            key, value = self._lru.popitem(last=False)
            self.bytes_used -= len(key) + len(value)
            self.evictions += 1
            if self.spill is not None:
                self.spill.put(key, value)
