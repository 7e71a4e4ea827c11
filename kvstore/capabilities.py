"""What a tier may declare beyond the chunk-store contract (kvstore/backend.py): each an ABC a
backend class inherits when it can do that thing, found by `isinstance`; a tier that cannot do
a thing does not declare it (docs/architecture.md, "Tiers and the storage manager"). Within a
declared capability, a limit the tier does not have is refused by name.

Wiring, read by the storage manager:
- `RemoteTier`: the tier talks to a server; its calls are bounded by `deadlines` and `check`
  makes one round trip (the read breaker's probe).
- `EvictingTier`: the tier evicts by itself within a byte budget; it asks the manager which keys
  are held for a load (never evicted) and tells it what it evicted.
- `ReadsInPlace`: the tier reads chunks straight into the caller's memory.
- `HandsOverEvictions`: the tier gives the chunks it evicts to the manager, which demotes them
  to the tier below (`TierSpec.fill`, "demote").

Operations, reached only through `kvstore.tier_operations.TierOperations`:
- `OperatedTier`, the one capability of operations: describe stored values, operator pins,
  limits changed at run time, usage per tenant and model, idle deletion.

Removal beside the contract's `delete`:
- `PrefixDeletable`: removes every key under a prefix, whoever wrote it (a tenant's keys);
  Redis can, though it cannot be operated (its own maxmemory policy evicts, pins or not).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvkeys.stored_keys import UsageGroup
    from kvstore.backend import Destination, EntryInfo
    from kvstore.deadlines import RemoteDeadlines


LOCAL_TIERS = frozenset({"cpu", "device"})
"""Tier kinds that live in one process's memory: nothing outside it reads their chunks, and it
sees every eviction of theirs."""


class RemoteTier(ABC):
    """A tier behind a server (redis, the cache server)."""

    # How long each kind of call may wait on the server; the manager counts calls past them.
    deadlines: RemoteDeadlines

    @abstractmethod
    def check(self) -> None:
        """Returns when the server answers now (one round trip); raises BackendError when it cannot
        be reached."""


class EvictingTier(ABC):
    """A tier that evicts by itself to stay within its byte budget."""

    _on_evict: Callable[[list[str]], None] | None = None

    @abstractmethod
    def set_hold_check(self, is_held: Callable[[str], bool]) -> None:
        """Installs the storage manager's load-hold predicate: a held key is never evicted."""

    def set_eviction_listener(self, on_evict: Callable[[list[str]], None]) -> None:
        """Installs the callback told the keys this tier evicted to make room (never keys a caller
        deleted). It may run under the tier's lock: it must be quick and must not call the tier."""
        self._on_evict = on_evict

    def _evicted(self, keys: list[str]) -> None:
        if keys and self._on_evict is not None:
            self._on_evict(keys)


class HandsOverEvictions(ABC):
    """A tier that gives each chunk it evicts to make room to a callback (the storage manager
    demotes it to the tier below)."""

    @abstractmethod
    def set_hand_over(self, on_evict: Callable[[list[tuple[str, torch.Tensor]]], None]) -> None:
        """Installs the callback given the evicted chunks, (key, K/V) each, once the tier has let
        go of them and outside its lock; it must be quick (it queues the writes)."""


class ReadsInPlace(ABC):
    """A tier that can fill the caller's memory straight from its stored values."""

    # Whether this instance can (a tier may store values it cannot read in place, e.g. encoded).
    reads_in_place: bool = True

    @abstractmethod
    def batched_read_into(self, keys: Sequence[str], dests: Sequence[Destination]
                          ) -> list[torch.Tensor | Destination | None]:
        """Returns per key its destination once the chunk was read straight into it and checked;
        else the chunk as `batched_get(read_only=True)` returns it (a value this tier cannot read
        in place), or None on a miss (a destination may then hold anything)."""


class OperatedTier(ABC):
    """A tier an operator can inspect, pin, re-budget and clean (`/kv/inspect`, `/kv/pin`,
    `/kv/budget`, `/kv/clear`): it indexes every chunk it holds with its size and last use."""

    @abstractmethod
    def describe(self, keys: Sequence[str]) -> list[EntryInfo | None]:
        """Returns per key what this tier knows of its stored value, or None when it is not stored."""

    @abstractmethod
    def pin(self, keys: Sequence[str], ttl_s: float | None = None) -> int:
        """Pins every stored key against eviction (for `ttl_s` seconds; None: until unpinned), all
        or none; returns the bytes newly pinned. PinError (nothing pinned) when a key is not
        stored here or the pins would pass this tier's pin budget."""

    @abstractmethod
    def unpin(self, keys: Sequence[str]) -> int:
        """Releases the operator pins of `keys`; returns how many were pinned."""

    @abstractmethod
    def set_budget(self, byte_budget: int | None = None, pin_budget: int | None = None,
                   tenant_quota: int | None = None) -> None:
        """Changes the limits given (None: unchanged), evicting least recently used chunks (never
        pinned) to meet them before it returns; BudgetError or ValueError: nothing changed."""

    @abstractmethod
    def usage(self) -> dict[UsageGroup, tuple[int, int]]:
        """Returns per (tenant tag, key family) of the chunks this tier holds (kvkeys/stored_keys.py
        `usage_group`; keys naming no chunk are not counted) their (entries, bytes)."""

    @abstractmethod
    def delete_idle(self, older_than_s: float) -> int:
        """Removes every stored chunk not used for `older_than_s` seconds (never a pinned one, nor
        the tier's own bookkeeping: `kvkeys.stored_keys.is_chunk_key`); returns how many."""


class PrefixDeletable(ABC):
    """A tier that can find every key under a prefix, whoever wrote it."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Removes every stored key starting with `prefix` (non-empty), whoever wrote it; returns
        how many."""
