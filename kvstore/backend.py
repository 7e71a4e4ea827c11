"""The one storage-backend interface every tier implements
(docs/architecture.md, "Tiers and the storage manager").

Keys are opaque strings (built by kvkeys/keyspace.py), identical across processes and machines. Values are
KV chunk tensors `(num_layers, 2, num_tokens, num_kv_heads, head_size)`. Memory tiers hold
tensors; tiers that store bytes (disk, redis, the cache server) derive from `BytesBackend`,
which frames each chunk as one self-describing value through `kvstore.serde` so that a
corrupted, truncated or foreign value is a miss (None), never KV.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

import torch

from kvstore import serde
from kvstore.codecs import Buffer, Codec, QuantCodec, get_codec
from kvstore.pin_set import PinInfo

# What a BytesBackend's `_encode` returns and its `_batched_put_bytes` stores: one buffer, or
# header and payload unjoined for tiers that write the two parts separately.
StoredValue = Buffer | serde.SplitValue
ReadValue = Buffer | serde.CheckedValue
"""What a tier's read hook returns: the value, or the value with its check fed as it was read."""


@dataclass(frozen=True)
class Destination:
    """Memory a chunk is read straight into (`batched_read_into`): its shape and dtype, and byte views
    (format "B", contiguous) whose bytes, end to end, take the chunk's bytes in C order."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    views: Sequence[memoryview]

    def __post_init__(self) -> None:
        if any(v.format != "B" or not v.c_contiguous or v.readonly for v in self.views):
            raise ValueError("destination views must be writable, contiguous byte views (format 'B')")

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.views)


def leading_run(held: Sequence[bool]) -> int:
    """Returns how many of `held`, counted from the start, are true (the prefix a tier holds)."""
    return next((n for n, h in enumerate(held) if not h), len(held))


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
    rejected: int = 0  # puts refused because the value cannot fit (too big, or only pinned keys left)
    can_pin: bool = False  # whether the operator can pin chunks here (kvstore/pin_set.py)
    pinned_entries: int = 0  # operator pins held now
    pinned_bytes: int = 0
    pin_budget: int | None = None  # bytes operator pins may hold at once (None: no bound)


@dataclass(frozen=True)
class EntryInfo:
    """What a tier knows of one stored value (`describe`); None where it cannot tell: its
    stored bytes, seconds since it was stored and since it was last used, and its operator pin
    (with the seconds before that pin expires, None: never)."""

    nbytes: int | None = None
    age_s: float | None = None
    idle_s: float | None = None
    pinned: bool = False
    pin_expires_in_s: float | None = None

    @classmethod
    def held(cls, nbytes: int | None, age_s: float | None, idle_s: float | None, pin: PinInfo | None) -> EntryInfo:
        """Returns a stored value's figures with its operator pin (None: not pinned)."""
        return cls(nbytes, age_s, idle_s, pin is not None, pin.expires_in_s if pin is not None else None)


class StorageBackend(ABC):
    """A tier: the chunk-store contract, all a new backend must write (six methods, and `close`
    where it holds connections or files). The storage manager calls a tier through nothing
    else, and through the capabilities it declares (kvstore/capabilities.py).

    Keys are non-empty str; values are chunk tensors `(num_layers, 2, num_tokens,
    num_kv_heads, head_size)`. Batched forms are the primitives: one round trip where the tier
    can batch, results in the order of the keys. Any method may raise BackendError on an I/O
    failure; none returns wrong data (a corrupt, truncated or foreign value is a miss).

    - `batched_contains(keys) -> list[bool]`: per key, whether it is stored now (a later read
      may still miss: it can be evicted in between).
    - `batched_get(keys, read_only=False) -> list[Tensor | None]`: per key its chunk, or None
      on a miss. The caller owns each tensor; with `read_only` it may be the tier's own stored
      tensor (memory tiers skip the copy), which the caller must never modify.
    - `batched_put(items, owned=False) -> list[bool]`: stores each `(key, chunk)`, replacing an
      earlier value and evicting (never a held key) to stay within the byte budget; per item
      whether it was accepted (False: it cannot fit, counted in `stats().rejected`). `owned`:
      the tensors are handed over, so a memory tier may keep them without a copy.
    - `delete(key) -> bool`: removes `key`; whether it was present.
    - `clear() -> None`: removes every chunk this tier owns (see each tier).
    - `stats() -> BackendStats`: this tier's counters and usage, as far as it knows them.
    - `close() -> None`: releases connections and files.

    `contains`, `get` and `put` are the batched forms with one key, defined here once and never
    overridden (tests/kvstore/test_backend_contract.py). Construction is each class's
    `from_spec(spec)`, which `kvstore.registry` calls.
    """

    name: str = "backend"
    # Where this tier keeps chunks: puts of chunks elsewhere are staged there once for all
    # tiers on that device (memory tiers on a GPU say so; byte tiers read host memory).
    device: torch.device = torch.device("cpu")
    # Whether every value reads back bit for bit (no lossy codec), so the tier may hold values
    # that are not K/V (connector/key_families.py's index).
    exact: bool = True

    @abstractmethod
    def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        """Returns, per key, whether it is stored (one query where the tier can batch)."""

    @abstractmethod
    def batched_get(self, keys: Sequence[str], *, read_only: bool = False) -> list[torch.Tensor | None]:
        """Returns one chunk or None (a miss, or a corrupt value) per key, in order; with
        `read_only` a result may be the tier's own tensor, never to be modified."""

    @abstractmethod
    def batched_put(self, items: Sequence[tuple[str, torch.Tensor]], *, owned: bool = False) -> list[bool]:
        """Stores every item within the byte budget; returns per item whether it was accepted.
        `owned`: the tensors are handed over and may be kept without a copy."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Removes `key`; returns whether it was present."""

    @abstractmethod
    def clear(self) -> None:
        """Removes every chunk this backend owns."""

    @abstractmethod
    def stats(self) -> BackendStats:
        """Returns a snapshot of this tier's counters and usage."""

    def close(self) -> None:
        """Releases connections and files; the backend is unusable afterwards."""

    # -- conveniences: the batched forms with one key --------------------------------------
    @final
    def contains(self, key: str) -> bool:
        """Returns whether `key` is stored (`batched_contains` of one key)."""
        return self.batched_contains([key])[0]

    @final
    def get(self, key: str) -> torch.Tensor | None:
        """Returns the caller's own copy of the chunk stored under `key`, or None (`batched_get`)."""
        return self.batched_get([key])[0]

    @final
    def put(self, key: str, kv: torch.Tensor) -> bool:
        """Stores a copy of `kv` under `key`; returns whether it was accepted (`batched_put`)."""
        return self.batched_put([(key, kv)])[0]


class BytesBackend(StorageBackend):
    """Base for tiers that store bytes (disk, redis, the cache server).

    Each chunk is framed by `kvstore.serde` with this tier's codec into one self-describing
    value. Subclasses implement the contract's existence and removal methods themselves, and
    three byte-level hooks for the rest: `_batched_get_bytes`, `_batched_put_bytes` and
    `_usage` (and may override `_encode`). A value that fails to decode (corrupt, truncated,
    foreign) is counted in `stats().corrupt`, deleted best-effort, and returned as a miss.
    """

    def __init__(self, codec: Codec | str = "raw") -> None:
        self.codec = get_codec(codec) if isinstance(codec, str) else codec
        self.exact = not isinstance(self.codec, QuantCodec)
        self._stats_lock = threading.Lock()
        self._hits = self._misses = self._puts = self._corrupt = self._rejected = 0

    # -- byte-level hooks ---------------------------------------------------------------
    @abstractmethod
    def _batched_get_bytes(self, keys: Sequence[str]) -> Sequence[ReadValue | None]:
        """Returns the stored value of each key, or None for each absent one."""

    @abstractmethod
    def _batched_put_bytes(self, items: Sequence[tuple[str, StoredValue]]) -> list[bool]:
        """Stores each value (what this tier's `_encode` returned), replacing any earlier one;
        returns per item whether it was accepted (False: refused for lack of room, counted)."""

    @abstractmethod
    def _usage(self) -> tuple[int, int, int | None, int]:
        """Returns (entries, bytes_used, byte_budget, evictions) as far as this tier knows."""

    def _encode(self, key: str, kv: torch.Tensor) -> StoredValue:
        """Returns the stored value for `kv` under `key` with this tier's codec (one buffer).
        Tiers that write header and payload separately may return `serde.SplitValue` instead
        (it has `len()`), and then get it in their `_batched_put_bytes`."""
        return serde.encode(key, kv, self.codec)

    # -- the contract on top ---------------------------------------------------------------
    def _decode(self, key: str, value: ReadValue | None) -> torch.Tensor | None:
        """Returns the chunk in `value`, or None (counted as a miss or as corrupt)."""
        if value is None:
            self._count(hit=False)
            return None
        try:
            kv = serde.decode(key, value)
        except serde.SerdeError:
            self._refuse(key)
            return None
        self._count(hit=True)
        return kv

    def _count(self, hit: bool) -> None:
        with self._stats_lock:
            if hit:
                self._hits += 1
            else:
                self._misses += 1

    def _refuse(self, key: str) -> None:
        """Counts `key`'s value as corrupt (and a miss) and deletes it, best effort."""
        with self._stats_lock:
            self._corrupt += 1
            self._misses += 1
        try:
            self.delete(key)
        except BackendError:
            pass

    def batched_get(self, keys: Sequence[str], *, read_only: bool = False) -> list[torch.Tensor | None]:
        """Returns each chunk freshly decoded (`read_only` changes nothing: it is the caller's own)."""
        return [self._decode(k, v) for k, v in zip(keys, self._batched_get_bytes(keys))] if keys else []

    def batched_put(self, items: Sequence[tuple[str, torch.Tensor]], *, owned: bool = False) -> list[bool]:
        """Stores each item encoded with this tier's codec (`owned` changes nothing: the value is new)."""
        if not items:
            return []
        accepted = self._batched_put_bytes([(k, self._encode(k, kv)) for k, kv in items])
        with self._stats_lock:
            self._puts += sum(accepted)
        return accepted

    def stats(self) -> BackendStats:
        entries, used, budget, evictions = self._usage()
        with self._stats_lock:
            return BackendStats(entries=entries, bytes_used=used, byte_budget=budget, hits=self._hits,
                                misses=self._misses, puts=self._puts, evictions=evictions,
                                corrupt=self._corrupt, rejected=self._rejected)
