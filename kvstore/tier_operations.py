"""Operating the cache: one service over a storage manager's tiers (`StorageManager.operations`),
for `/kv/inspect`, `/kv/pin`, `/kv/budget`, `/kv/clear`, `kvtier cache` and forgetting a tenant
(docs/architecture.md, "Tiers and the storage manager"; docs/serving.md, "Operating the cache").

- A tier is addressed one way: by name (`tier`): its full name ("0:cpu"), its URL, or its kind
  ("cpu", "disk") when one tier is of that kind; None, where one tier is meant, is the fastest.
- Every call reaches a tier through the same guard as the data path (kvstore/tier_guard.py):
  a tier backing off after failures is not called, calls are timed against its deadlines and
  counted. Reads (describe, usage, what is held) answer "nothing" for such a tier, as a lookup
  does; changes raise, naming the tier and why.
- What a tier can do is found by type (kvstore/capabilities.py); asking a tier for what it
  cannot do names the tiers that can.
- Operations touch chunks only: a key that is a tier's own bookkeeping
  (`kvkeys.stored_keys.is_chunk_key` false) is refused, never pinned, copied or removed.
- Operator pins (`pin`, `unpin`) belong to a tier; the manager's load holds
  (kvstore/load_holds.py) are another thing and are never touched here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TypeVar

import torch

from kvkeys.stored_keys import UsageGroup, is_chunk_key
from kvstore.backend import BackendError, EntryInfo, StorageBackend, leading_run
from kvstore.budget import BudgetError
from kvstore.capabilities import OperatedTier, PrefixDeletable, RemoteTier
from kvstore.deadlines import CallKind
from kvstore.device_staging import stage
from kvstore.load_holds import LoadHolds
from kvstore.pin_set import PinError
from kvstore.tier_events import TierEvents
from kvstore.tier_guard import SKIPPED, TierGuard

T = TypeVar("T")

PerTier = tuple[dict[str, int], dict[str, str]]
"""Per tier name the values removed, and per tier that could not its reason."""


def _chunks_only(keys: Sequence[str]) -> list[str]:
    keys = list(keys)
    bad = next((k for k in keys if not is_chunk_key(k)), None)
    if bad is not None:
        raise ValueError(f"{bad!r} is a tier's own bookkeeping, not a chunk: operations touch chunks only")
    return keys


class TierOperations:
    """The operations over one manager's tiers; thread-safe as the tiers are."""

    def __init__(self, guards: Sequence[TierGuard], holds: LoadHolds, events: TierEvents,
                 flush: Callable[[], bool]) -> None:
        self._guards = list(guards)
        self._holds = holds
        self._events = events
        self._flush = flush
        self.names = [g.name for g in self._guards]

    # -- addressing --------------------------------------------------------------------------
    def index(self, tier: str | None) -> int:
        """Returns the position (fastest first) of the tier `tier` names; ValueError listing the
        names when it names none, or more than one."""
        if tier is None:
            return 0
        for i, full in enumerate(self.names):
            if tier in (full, full.split(":", 1)[-1]):
                return i
        kinds = [i for i, g in enumerate(self._guards) if g.tier.name == tier]
        if len(kinds) == 1:
            return kinds[0]
        raise ValueError(f"tier {tier!r}: no such tier (or more than one of that kind); "
                         f"this server's tiers are {', '.join(self.names)}")

    def name(self, tier: str | None) -> str:
        """Returns the full name of the tier `tier` names (ValueError as `index`)."""
        return self.names[self.index(tier)]

    def _operated(self, tier: str | None, error: type[Exception], what: str,
                  remote_hint: str = "") -> tuple[int, OperatedTier]:
        """Returns the position and backend of the tier `tier` names; `error` naming the tiers
        that can (and, for a server-backed tier, `remote_hint`) when it cannot be operated."""
        i = self.index(tier)
        backend = self._guards[i].tier
        if not isinstance(backend, OperatedTier):
            able = [n for n, g in zip(self.names, self._guards) if isinstance(g.tier, OperatedTier)]
            hint = remote_hint if isinstance(backend, RemoteTier) else ""
            raise error(f"tier {self.names[i]} cannot {what};{hint}"
                        + (f" here {', '.join(able)} can" if able else " no tier here can"))
        return i, backend

    def _change(self, i: int, fn: Callable[[], T], refusal: type[Exception]) -> T:
        """Returns fn()'s result on tier i through its write guard; its failure is raised as `refusal`
        naming the tier (nothing changed there)."""
        try:
            return self._guards[i].operate(fn, "write", refusals=(refusal, ValueError))
        except (refusal, ValueError):
            raise
        except BackendError as exc:
            raise refusal(f"tier {self.names[i]} failed: {exc}") from exc

    def _read(self, i: int, fn: Callable[[], T], kind: CallKind = "lookup") -> T | None:
        got = self._guards[i].call(fn, kind)
        return None if got is SKIPPED else got

    # -- reading ------------------------------------------------------------------------------
    def describe(self, keys: Sequence[str]) -> dict[str, list[EntryInfo | None]]:
        """Returns per tier name (fastest first) what it knows of each key's stored value (None:
        not stored there; a tier that cannot describe tells existence alone); a tier backing off
        answers all None."""
        keys = list(keys)
        out: dict[str, list[EntryInfo | None]] = {}
        for i, g in enumerate(self._guards):
            tier = g.tier
            fn = partial(tier.describe, keys) if isinstance(tier, OperatedTier) else partial(_existence, tier, keys)
            got = self._read(i, fn) if keys else []
            out[self.names[i]] = [None] * len(keys) if got is None else list(got)
        return out

    def contains(self, keys: Sequence[str]) -> dict[str, list[bool] | None]:
        """Returns per tier name per key whether that tier holds it, or None for a tier backing
        off or failing: one batched existence query per tier."""
        keys = list(keys)
        out: dict[str, list[bool] | None] = {}
        for i, g in enumerate(self._guards):
            got = self._read(i, partial(g.tier.batched_contains, keys)) if keys else []
            out[self.names[i]] = None if got is None else [bool(h) for h in got]
        return out

    def evicted(self, keys: Sequence[str]) -> dict[str, list[bool] | None]:
        """Returns per tier name per key whether that tier evicted it lately (and holds no newer
        value), None for a tier whose evictions this process does not all see (a shared tier)."""
        return {n: self._events.recently_evicted(i, keys) for i, n in enumerate(self.names)}

    def usage(self) -> dict[str, dict[UsageGroup, tuple[int, int]] | None]:
        """Returns per tier name its (entries, bytes) per (tenant tag, key family) of the chunks it
        holds, None where the tier cannot be operated or is backing off."""
        out: dict[str, dict[UsageGroup, tuple[int, int]] | None] = {}
        for i, g in enumerate(self._guards):
            tier = g.tier
            out[self.names[i]] = self._read(i, tier.usage) if isinstance(tier, OperatedTier) else None
        return out

    def held_prefix(self, tier: str | None, keys: Sequence[str]) -> int:
        """Returns how many of `keys` from the start the tier `tier` names holds (0 while it backs off)."""
        i = self.index(tier)
        got = self._read(i, partial(self._guards[i].tier.batched_contains, list(keys))) if keys else []
        return leading_run(got or [])

    # -- changing ------------------------------------------------------------------------------
    def pin(self, tier: str | None, keys: Sequence[str], ttl_s: float | None = None) -> int:
        """Pins `keys` in the tier `tier` names against eviction, all or none (for `ttl_s`
        seconds; None: until unpinned); returns the bytes newly pinned. PinError (nothing
        pinned) names why: a key not held, the tier's pin budget, a tier that cannot pin or is
        failing."""
        keys = _chunks_only(keys)
        i, backend = self._operated(tier, PinError, "pin chunks")
        return self._change(i, partial(backend.pin, keys, ttl_s), PinError)

    def unpin(self, tier: str | None, keys: Sequence[str]) -> int:
        """Releases the operator pins of `keys` in the tier `tier` names; returns how many were
        pinned. PinError names a tier that cannot pin or failed (nothing released there)."""
        keys = _chunks_only(keys)
        i, backend = self._operated(tier, PinError, "pin chunks")
        return self._change(i, partial(backend.unpin, keys), PinError)

    def set_budget(self, tier: str | None, byte_budget: int | None = None, pin_budget: int | None = None,
                   tenant_quota: int | None = None) -> str:
        """Returns the full name of the tier `tier` names once it met the limits given (None:
        unchanged); ValueError (unknown tier, no or bad limit) or BudgetError (refused, or a
        tier that cannot change its limits): nothing changed."""
        if byte_budget is None and pin_budget is None and tenant_quota is None:
            raise ValueError("give at least one of byte_budget, pin_budget and tenant_quota")
        i, backend = self._operated(tier, BudgetError, "change its limits at run time",
                                    " its server's memory is the server's own (Redis: CONFIG SET maxmemory);")
        self._change(i, partial(backend.set_budget, byte_budget, pin_budget, tenant_quota), BudgetError)
        return self.names[i]

    def copy(self, src: str | None, dst: str | None, keys: Sequence[str]) -> int:
        """Copies the values of `keys` from tier `src` into tier `dst`, in order, now; returns how
        many were copied: it stops at the first value the source no longer holds or the target
        refuses (a tier backing off copies nothing). The keys are held meanwhile (kvstore/load_holds.py),
        so no tier evicts them mid-copy."""
        keys = _chunks_only(keys)
        s, d = self.index(src), self.index(dst)
        if not keys or s == d:
            return 0
        source, target = self._guards[s].tier, self._guards[d].tier
        self._holds.hold(keys)
        try:
            got = self._read(s, partial(source.batched_get, keys), "load")
            found: list[tuple[str, torch.Tensor]] = []
            for key, kv in zip(keys, got or []):
                if kv is None or (not target.exact and not kv.is_floating_point()):
                    break  # a gap, or a value a lossy codec cannot take (it takes floating-point K/V)
                found.append((key, kv))
            if not found:
                return 0
            items = stage(found, {target.device})[0][target.device]
            accepted = self._guards[d].store(items, owned=True)
            if accepted is SKIPPED:
                return 0
            self._events.stored(d, [k for (k, _), ok in zip(items, accepted) if ok])
            return leading_run(accepted)
        finally:
            self._holds.release(keys)

    def delete(self, tier: str | None, keys: Sequence[str]) -> int:
        """Removes `keys` from the tier `tier` names alone, pinned or not (an explicit removal
        beats a pin), after queued writes; returns how many it held. BackendError names a tier
        backing off or failing."""
        keys = _chunks_only(keys)
        i = self.index(tier)
        self._flush()
        backend = self._guards[i].tier
        removed = self._guards[i].operate(lambda: [k for k in keys if backend.delete(k)], "write")
        self._events.removed(i, removed)
        return len(removed)

    def delete_idle(self, older_than_s: float) -> PerTier:
        """Removes from every tier that indexes its chunks those not used for `older_than_s`
        seconds (never a pinned one), after queued writes; the others are reported as unable."""
        self._flush()
        return self._each_tier("tell when its chunks were last used",
                               lambda t: partial(t.delete_idle, older_than_s) if isinstance(t, OperatedTier) else None)

    def delete_prefix(self, prefix: str) -> PerTier:
        """Removes every key starting with `prefix` (non-empty) from every tier, after queued
        writes; a tier in the errors may still hold some."""
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix")
        self._flush()
        return self._each_tier("find keys by prefix",
                               lambda t: partial(t.delete_prefix, prefix) if isinstance(t, PrefixDeletable) else None)

    def _each_tier(self, what: str, removal: Callable[[StorageBackend], Callable[[], int] | None]) -> PerTier:
        """Runs on every tier its `removal` (None: the tier cannot `what`), through its write
        guard; returns (per tier its count, per tier that could not its reason), one tier's
        failure never stopping the others."""
        removed: dict[str, int] = {}
        errors: dict[str, str] = {}
        for name, guard in zip(self.names, self._guards):
            remove = removal(guard.tier)
            if remove is None:
                errors[name] = f"tier {name} cannot {what}"
                continue
            try:
                removed[name] = guard.operate(remove, "write")
            except Exception as exc:  # noqa: BLE001 - reported per tier, never raised past the others
                errors[name] = f"{type(exc).__name__}: {exc}"
        return removed, errors


def _existence(tier: StorageBackend, keys: list[str]) -> list[EntryInfo | None]:
    return [EntryInfo() if held else None for held in tier.batched_contains(keys)]
