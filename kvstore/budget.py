"""Byte accounting for one tier: sizes, an eviction policy, a hard byte budget, and the
operator's pins (kvstore/pin_set.py) with their own budget."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvstore.eviction import EvictionPolicy, LRUPolicy
from kvstore.pin_set import PinSet
from kvstore.tenant_keys import key_tenant
from kvstore.tenant_quota import TenantBytes, never_pinned


class ByteBudget:
    """Tracks `key -> stored bytes` of a tier and picks victims so that `used <= budget` always,
    and, with a `tenant_quota`, every tenant's bytes <= the quota (its own entries evicted first).

    Not thread-safe on its own: the owning tier calls it under its lock. `is_pinned` is set by
    the storage manager (keys being loaded); `pinned` holds the operator's pins (at most
    `pin_budget` bytes, None: no bound); a key pinned either way is never chosen as a victim,
    and a key removed loses its operator pin. `times` keeps each key's (stored, last used)
    wall-clock times, for inspection.
    """

    def __init__(self, budget: int | None, policy: EvictionPolicy | None = None,
                 tenant_quota: int | None = None, pin_budget: int | None = None,
                 pin_clock: Callable[[], float] = time.monotonic) -> None:
        if budget is not None and budget < 0:
            raise ValueError(f"byte budget must be >= 0, got {budget}")
        self.budget = budget
        self.policy = policy if policy is not None else LRUPolicy()
        self.sizes: dict[str, int] = {}
        self.used = 0
        self.is_pinned: Callable[[str], bool] = never_pinned
        self.tenants: TenantBytes[str] = TenantBytes(tenant_quota, key_tenant)
        self.pinned = PinSet(pin_budget, pin_clock)  # a persisted set's clock: time.time
        self.times: dict[str, tuple[float, float]] = {}

    def protected(self, key: str) -> bool:
        """Returns whether `key` may not be evicted: being loaded, or pinned by the operator."""
        return self.is_pinned(key) or self.pinned.holds(key)

    def __contains__(self, key: str) -> bool:
        return key in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def plan(self, key: str, nbytes: int) -> list[str] | None:
        """Returns the keys to evict so that `key` (of `nbytes`) fits, or None if it cannot fit
        (larger than the budget or its tenant's quota, or only pinned keys are left to evict).
        A salted key's own tenant's entries go first, down to its quota; then the tier's
        order, down to the budget. Changes nothing (but releases operator pins found expired)."""
        victims = self.tenants.own_victims(key, nbytes, self.sizes, self.policy.victims, self.protected)
        if victims is None:
            return None
        if self.budget is None:
            return victims
        if nbytes > self.budget:
            return None
        chosen = set(victims)
        free = self.budget - self.used + self.sizes.get(key, 0) + sum(self.sizes[v] for v in victims)
        if free >= nbytes:
            return victims
        for victim in self.policy.victims():
            if victim == key or victim in chosen or self.protected(victim):
                continue
            victims.append(victim)
            free += self.sizes[victim]
            if free >= nbytes:
                return victims
        return None

    def add(self, key: str, nbytes: int) -> None:
        """Records `key` as stored with `nbytes` (replacing an earlier size)."""
        delta = nbytes - self.sizes.get(key, 0)
        self.used += delta
        self.tenants.record(key, delta)
        self.sizes[key] = nbytes
        self.policy.on_insert(key)
        self.pinned.resize(key, nbytes)
        now = time.time()
        self.times[key] = (now, now)

    def remove(self, key: str) -> int:
        """Forgets `key`; returns the bytes it freed (0 if unknown)."""
        nbytes = self.sizes.pop(key, 0)
        self.used -= nbytes
        self.tenants.record(key, -nbytes)
        self.policy.on_remove(key)
        self.pinned.release(key)
        self.times.pop(key, None)
        return nbytes

    def touch(self, key: str) -> None:
        if key in self.sizes:
            self.policy.on_access(key)
            self.times[key] = (self.times.get(key, (time.time(), 0.0))[0], time.time())

    def by_tenant(self) -> dict[str, tuple[int, int]]:
        """Returns per tenant tag (salted keys only) its (entries, bytes)."""
        out: dict[str, tuple[int, int]] = {}
        for key, nbytes in self.sizes.items():
            tag = key_tenant(key)
            if tag is not None:
                n, b = out.get(tag, (0, 0))
                out[tag] = (n + 1, b + nbytes)
        return out

    def clear(self) -> None:
        for key in list(self.sizes):
            self.remove(key)
