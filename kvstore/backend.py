"""The one storage-backend interface every tier implements
(docs/architecture.md, "Tiers and the storage manager").

Keys are opaque strings (built by connector/keyspace.py), identical across processes and machines. Values are
KV chunk tensors `(num_layers, 2, num_tokens, num_kv_heads, head_size)`. Memory tiers hold
tensors; tiers that store bytes (disk, redis, the cache server) derive from `BytesBackend`,
which frames each chunk as one self-describing value through `kvstore.serde` so that a
corrupted, truncated or foreign value is a miss (None), never KV.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvstore import serde
from kvstore.codecs import Buffer, Codec, get_codec

if TYPE_CHECKING:
    from kvstore.config import TierSpec
    from kvstore.deadlines import RemoteDeadlines

# What a BytesBackend's `encode` returns and its `_put_bytes` stores: one buffer, or header and
# payload unjoined for tiers that write the two parts separately.
StoredValue = Buffer | serde.SplitValue
ReadValue = Buffer | serde.CheckedValue
"""What a tier's read hook returns: the value, or the value with its check fed as it was read."""


@dataclass(frozen=True)
class Destination:
    """Memory a chunk is read straight into (`read_into`): its shape and dtype, and byte views
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


class StorageBackend(ABC):
    """A tier. Every method may raise BackendError on an I/O failure; none returns wrong data."""

    name: str = "backend"
    # Where this tier keeps chunks: puts of chunks elsewhere are staged there once for all
    # tiers on that device (memory tiers on a GPU say so; byte tiers read host memory).
    device: torch.device = torch.device("cpu")
    # Remote tiers (redis, the cache server): how long each kind of call may wait on the server
    # (kvstore/deadlines.py); the storage manager counts calls past them. None: a local tier.
    deadlines: RemoteDeadlines | None = None

    @classmethod
    def from_spec(cls, spec: TierSpec) -> StorageBackend:
        """Returns a backend built from one configured tier (URL, byte budget, codec, options).

        This is the one construction signature every tier implements; `kvstore.registry`
        picks the class by the URL's scheme and calls it.
        """
        raise NotImplementedError(f"{cls.__name__} cannot be built from a TierSpec")

    def set_pin_check(self, is_pinned: Callable[[str], bool]) -> None:
        """Installs the storage manager's pin predicate: pinned keys are never evicted.
        Tiers without eviction ignore it."""

    _on_evict: Callable[[list[str]], None] | None = None

    def set_eviction_listener(self, on_evict: Callable[[list[str]], None]) -> None:
        """Installs the callback told the keys this tier evicted to make room (never keys a
        caller deleted). It may run under the tier's lock: it must be quick and must not call
        the tier. A tier that cannot see its evictions (a server evicting by itself) never
        calls it."""
        self._on_evict = on_evict

    def _evicted(self, keys: list[str]) -> None:
        if keys and self._on_evict is not None:
            self._on_evict(keys)

    def check(self) -> None:
        """Returns when the tier answers now; raises BackendError when it cannot be reached.
        Local tiers always answer; network tiers make one round trip."""

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Returns whether `key` is stored (a later get may still miss if it is evicted)."""

    def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        """Returns, per key, whether it is stored (one query where the tier can batch)."""
        return [self.contains(k) for k in keys]

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

    def batched_read(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        """Returns what `batched_get` does, for reading only: a result may be the tier's own
        stored tensor (memory tiers skip the copy), so the caller must never modify it."""
        return self.batched_get(keys)

    # Whether `read_into` can fill memory straight from this tier's stored values.
    reads_in_place: bool = False

    def read_into(self, key: str, dest: Destination) -> bool | None:
        """Reads the chunk stored under `key` straight into `dest`. Returns True once `dest`
        holds it, checked as `get` checks it; False on a miss (absent, corrupt or foreign,
        counted as `get` counts it; `dest` may then hold anything); None, with `dest`
        untouched, when it cannot be read in place (this tier never does, or the value is not
        raw `dest.dtype` of `dest.shape`): `get` reads it."""
        return None

    def batched_read_into(self, keys: Sequence[str], dests: Sequence[Destination]
                          ) -> list[torch.Tensor | Destination | None]:
        """Returns per key its destination once the chunk was read into it (`read_into`),
        else the chunk as `batched_read` returns it (a value not readable in place), or None."""
        out: list[torch.Tensor | Destination | None] = []
        for key, dest in zip(keys, dests, strict=True):
            done = self.read_into(key, dest)
            out.append(dest if done else None if done is False else self.batched_read([key])[0])
        return out

    @abstractmethod
    def put(self, key: str, kv: torch.Tensor) -> bool:
        """Stores `kv` under `key`, evicting as needed to stay within the byte budget; returns
        whether the tier accepted it (False: it cannot fit, counted in `stats().rejected`)."""

    def batched_put(self, items: Sequence[tuple[str, torch.Tensor]]) -> list[bool]:
        """Stores every item (same guarantees as `put`); returns per item whether it was accepted."""
        return [self.put(key, kv) for key, kv in items]

    def batched_adopt(self, items: Sequence[tuple[str, torch.Tensor]]) -> list[bool]:
        """Stores every item like `batched_put`, but the tensors are handed over: memory tiers
        may keep them as they are instead of copying, so nobody may modify them afterwards.
        Returns per item whether it was accepted."""
        return self.batched_put(items)

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Removes `key`; returns whether it was present."""

    @abstractmethod
    def clear(self) -> None:
        """Removes every chunk this backend owns."""

    def delete_prefix(self, prefix: str) -> int:
        """Removes every stored key starting with `prefix` (non-empty), whoever wrote it (a
        tenant's keys: kvstore/tenant_keys.py); returns how many."""
        raise NotImplementedError(f"{type(self).__name__} cannot remove keys by prefix")

    @abstractmethod
    def stats(self) -> BackendStats: ...

    def close(self) -> None:
        """Releases connections and files; the backend is unusable afterwards."""


class BytesBackend(StorageBackend):
    """Base for tiers that store bytes (disk, redis, the cache server).

    Each chunk is framed by `kvstore.serde` with this tier's codec into one self-describing
    value. Subclasses implement only the byte-level hooks (`_get_bytes`, `_put_bytes`,
    `_contains`, `_delete`, `_clear`, `_usage`; batched variants default to loops). A value
    that fails to decode (corrupt, truncated, foreign) is counted in `stats().corrupt`,
    deleted best-effort, and returned as a miss.
    """

    def __init__(self, codec: Codec | str = "raw") -> None:
        self.codec = get_codec(codec) if isinstance(codec, str) else codec
        self._stats_lock = threading.Lock()
        self._hits = self._misses = self._puts = self._corrupt = self._rejected = 0

    # -- byte-level hooks ---------------------------------------------------------------
    @abstractmethod
    def _get_bytes(self, key: str) -> ReadValue | None:
        """Returns the stored value of `key`, or None if absent."""

    @abstractmethod
    def _put_bytes(self, key: str, value: StoredValue) -> bool:
        """Stores `value` (what this tier's `encode` returned) under `key`, replacing any earlier
        value; returns whether it was accepted (False: refused for lack of room, counted)."""

    @abstractmethod
    def _contains(self, key: str) -> bool: ...

    @abstractmethod
    def _delete(self, key: str) -> bool: ...

    @abstractmethod
    def _clear(self) -> None: ...

    @abstractmethod
    def _usage(self) -> tuple[int, int, int | None, int]:
        """Returns (entries, bytes_used, byte_budget, evictions) as far as this tier knows."""

    def _batched_get_bytes(self, keys: Sequence[str]) -> Sequence[ReadValue | None]:
        return [self._get_bytes(k) for k in keys]

    def _batched_put_bytes(self, items: Sequence[tuple[str, StoredValue]]) -> list[bool]:
        # `is not False`: an override that answers nothing (None) stored the value
        return [self._put_bytes(key, value) is not False for key, value in items]

    def _batched_contains(self, keys: Sequence[str]) -> list[bool]:
        return [self._contains(k) for k in keys]

    # -- the StorageBackend interface on top ---------------------------------------------
    def encode(self, key: str, kv: torch.Tensor) -> StoredValue:
        """Returns the stored value for `kv` under `key` with this tier's codec (one buffer).
        Tiers that write header and payload separately may return `serde.SplitValue` instead
        (it has `len()`), and then get it in their `_put_bytes`."""
        return serde.encode(key, kv, self.codec)

    def _read_in_place(self, key: str, dest: Destination) -> bool | None:
        """Reads `key`'s value straight into `dest` (tiers that can: `reads_in_place`).
        Returns True when read and checked, False if absent, None (`dest` untouched) when the
        value is not raw `dest.dtype` of `dest.shape`; raises SerdeError for a corrupt one."""
        return None

    def decode(self, key: str, value: ReadValue | None) -> torch.Tensor | None:
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

    def read_into(self, key: str, dest: Destination) -> bool | None:
        try:
            done = self._read_in_place(key, dest)
        except serde.SerdeError:
            self._refuse(key)
            return False
        if done is not None:
            self._count(hit=done)
        return done

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
            self._delete(key)
        except BackendError:
            pass

    def contains(self, key: str) -> bool:
        return self._contains(key)

    def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        return self._batched_contains(keys) if keys else []

    def prefix_hits(self, keys: Sequence[str]) -> int:
        n = 0
        for present in self._batched_contains(keys):
            if not present:
                break
            n += 1
        return n

    def get(self, key: str) -> torch.Tensor | None:
        return self.decode(key, self._get_bytes(key))

    def batched_get(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        return [self.decode(k, v) for k, v in zip(keys, self._batched_get_bytes(keys))]

    def put(self, key: str, kv: torch.Tensor) -> bool:
        return self.batched_put([(key, kv)])[0]

    def batched_put(self, items: Sequence[tuple[str, torch.Tensor]]) -> list[bool]:
        accepted = self._batched_put_bytes([(k, self.encode(k, kv)) for k, kv in items])
        if accepted is None:  # an override that answers nothing stored everything
            accepted = [True] * len(items)
        with self._stats_lock:
            self._puts += sum(accepted)
        return accepted

    def delete(self, key: str) -> bool:
        return self._delete(key)

    def clear(self) -> None:
        self._clear()

    def delete_prefix(self, prefix: str) -> int:
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix")
        return sum(self._delete(k) for k in self._keys_with_prefix(prefix))

    def _keys_with_prefix(self, prefix: str) -> list[str]:
        """Returns every stored key starting with `prefix` (tiers that can list them)."""
        raise NotImplementedError(f"{type(self).__name__} cannot list keys by prefix")

    def stats(self) -> BackendStats:
        entries, used, budget, evictions = self._usage()
        with self._stats_lock:
            return BackendStats(entries=entries, bytes_used=used, byte_budget=budget, hits=self._hits,
                                misses=self._misses, puts=self._puts, evictions=evictions,
                                corrupt=self._corrupt, rejected=self._rejected)
