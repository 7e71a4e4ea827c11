"""The per-tier index of the key families stored there (kvkeys/families.py), so a miss can be
explained (connector/explain.py) across processes without listing a tier.

The index of a shared tier (disk, Redis, the cache server) is one value under `INDEX_KEY`: a
JSON list of at most `MAX_FAMILIES` records (about 250 bytes each), held as a uint8 tensor
`(1, 2, n, 1, 1)` so any exact tier stores it. A process adds a family it stores the first time
it stores it (read, merge, write on the store thread, after the chunk's own put) and checks
again every `FAMILY_RECHECK_S` (one read), so a record lost to a concurrent writer or to eviction is
back within that time. A process-local tier (cpu, device) needs no index: its families are
this process's own. Tiers with a lossy codec keep none; a cache server client bound to one
tenant may not write it (its families are not listed there).
"""

from __future__ import annotations

import functools
import json
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict

import torch

from kvkeys.families import Family
from kvkeys.keyspace import Keyspace
from kvkeys.tenants import KEY_ROOT
from kvstore.background_queue import BACKGROUND_NICE, BackgroundQueue
from kvstore.deadlines import FAMILY_RECHECK_S
from kvstore.storage_manager import StorageManager

INDEX_KEY = f"{KEY_ROOT}index:families"
MAX_FAMILIES = 256


def encode_index(families: Sequence[Family]) -> torch.Tensor:
    """Returns the index value holding `families`."""
    raw = json.dumps([asdict(f) for f in families], separators=(",", ":")).encode()
    raw += b" " * (len(raw) % 2)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(1, 2, len(raw) // 2, 1, 1)


def decode_index(value: torch.Tensor | None) -> list[Family]:
    """Returns the families an index value lists ([] for none, or a value that is not one)."""
    if value is None or value.dtype != torch.uint8:
        return []
    try:
        records = json.loads(value.contiguous().view(-1).numpy().tobytes())
        return [Family(**r) for r in records]
    except (ValueError, TypeError):
        return []


class FamilyIndex:
    """This process's key families stored through one storage manager (every connector over
    it shares one: `FamilyIndex.of`), and the index of each shared tier. Thread-safe."""

    @classmethod
    def of(cls, storage: StorageManager) -> FamilyIndex:
        """Returns the index of `storage`'s families (made on first use)."""
        with _INDEXES_LOCK:
            index = _INDEXES.get(storage)
            if index is None:
                index = _INDEXES[storage] = cls(storage)
            return index

    def __init__(self, storage: StorageManager) -> None:
        self.storage = storage
        self._lock = threading.Lock()
        self._mine: dict[str, Family] = {}
        self._checked: dict[str, float] = {}  # family id -> when the shared tiers were last seen to list it

    def note(self, ks: Keyspace) -> Family | None:
        """Records that `ks`'s family is being stored; returns it when the shared tiers' index
        is due a check (`publish` it after the store), else None. Cheap: no I/O."""
        family = Family.of(ks)
        fid = family.id
        with self._lock:
            self._mine.setdefault(fid, family)
            if time.monotonic() - self._checked.get(fid, float("-inf")) < FAMILY_RECHECK_S:
                return None
            self._checked[fid] = time.monotonic()  # one check at a time
        return family

    def publish(self, family: Family) -> None:
        """Adds `family` to each shared tier's index that does not list it: one read per tier,
        and a write where it was missing. Failures are left to the next check."""
        for name in self.storage.names:
            if self.storage.is_local(name):
                continue
            listed = self.listed(name)
            if family.id in {f.id for f in listed}:
                continue
            merged = [family, *(f for f in listed if f.id != family.id)][:MAX_FAMILIES]
            self.storage.tier_put(name, INDEX_KEY, encode_index(merged))

    def publish_later(self, family: Family) -> None:
        """Queues `publish(family)` on the process's one index thread, so a shared tier that
        hangs never holds up the caller (the store thread); a full queue drops it, and the
        family's next check (`FAMILY_RECHECK_S`) tries again."""
        _publisher().submit(functools.partial(self.publish, family))

    def forget_tenant(self, tenant: str) -> None:
        """Drops tenant `tenant`'s families from this process's and from each shared tier's
        index (with its entries, `forget_tenant` removes its sealed roots)."""
        self.forget(lambda f: f.tenant == tenant)

    def forget(self, match: Callable[[Family], bool]) -> None:
        """Drops the families `match` selects from this process's and each shared tier's index."""
        with self._lock:
            for fid in [fid for fid, f in self._mine.items() if match(f)]:
                del self._mine[fid]
                self._checked.pop(fid, None)
        for name in self.storage.names:
            if self.storage.is_local(name):
                continue
            listed = self.listed(name)
            kept = [f for f in listed if not match(f)]
            if len(kept) < len(listed):
                self.storage.tier_put(name, INDEX_KEY, encode_index(kept))

    def listed(self, name: str) -> list[Family]:
        """Returns the families the tier named `name` is known to hold keys of: a local tier's
        are this process's, a shared tier's its index's (one read)."""
        if self.storage.is_local(name):
            with self._lock:
                return list(self._mine.values())
        return decode_index(self.storage.tier_get(name, INDEX_KEY))


_PUBLISHER: BackgroundQueue | None = None


def _publisher() -> BackgroundQueue:
    """Returns the process's index thread (started on first use)."""
    global _PUBLISHER
    with _INDEXES_LOCK:
        if _PUBLISHER is None:
            _PUBLISHER = BackgroundQueue(16, "drop_new", "kvtier-family-index", nice=BACKGROUND_NICE)
        return _PUBLISHER


def flush_index(timeout: float | None = None) -> bool:
    """Waits until the index thread ran every queued publish; returns False on timeout."""
    with _INDEXES_LOCK:
        publisher = _PUBLISHER
    return publisher is None or publisher.flush(timeout)


_INDEXES: weakref.WeakKeyDictionary[StorageManager, FamilyIndex] = weakref.WeakKeyDictionary()
_INDEXES_LOCK = threading.Lock()
