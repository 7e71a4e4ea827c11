"""Byte accounting for one tier: sizes, an eviction policy and a hard byte budget."""

from __future__ import annotations

from collections.abc import Callable

from kvstore.eviction import EvictionPolicy, LRUPolicy
from kvstore.tenant_keys import key_tenant
from kvstore.tenant_quota import TenantBytes, never_pinned


class ByteBudget:
    """Tracks `key -> stored bytes` of a tier and picks victims so that `used <= budget` always,
    and, with a `tenant_quota`, every tenant's bytes <= the quota (its own entries evicted first).

    Not thread-safe on its own: the owning tier calls it under its lock. `is_pinned` is set by
    the storage manager; pinned keys are never chosen as victims.
    """

    def __init__(self, budget: int | None, policy: EvictionPolicy | None = None,
                 tenant_quota: int | None = None) -> None:
        if budget is not None and budget < 0:
            raise ValueError(f"byte budget must be >= 0, got {budget}")
        self.budget = budget
        self.policy = policy if policy is not None else LRUPolicy()
        self.sizes: dict[str, int] = {}
        self.used = 0
        self.is_pinned: Callable[[str], bool] = never_pinned
        self.tenants: TenantBytes[str] = TenantBytes(tenant_quota, key_tenant)

    def __contains__(self, key: str) -> bool:
        return key in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def plan(self, key: str, nbytes: int) -> list[str] | None:
        """Returns the keys to evict so that `key` (of `nbytes`) fits, or None if it cannot fit
        (larger than the budget or its tenant's quota, or only pinned keys are left to evict).
        A salted key's own tenant's entries go first, down to its quota; then the tier's
        order, down to the budget. Changes nothing."""
        victims = self.tenants.own_victims(key, nbytes, self.sizes, self.policy.victims, self.is_pinned)
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
            if victim == key or victim in chosen or self.is_pinned(victim):
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

    def remove(self, key: str) -> int:
        """Forgets `key`; returns the bytes it freed (0 if unknown)."""
        nbytes = self.sizes.pop(key, 0)
        self.used -= nbytes
        self.tenants.record(key, -nbytes)
        self.policy.on_remove(key)
        return nbytes

    def touch(self, key: str) -> None:
        if key in self.sizes:
            self.policy.on_access(key)

    def clear(self) -> None:
        for key in list(self.sizes):
            self.remove(key)
