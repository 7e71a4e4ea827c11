"""Byte accounting for one tier: sizes, an eviction policy, a hard byte budget, and the
operator's pins (kvstore/pin_set.py) with their own budget. The limits may change at run time
(`plan_limits`, `apply_limits`: `POST /kv/budget`), the tier evicting at once to meet them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvkeys.tenants import key_tenant
from kvstore.eviction import EvictionPolicy, LRUPolicy
from kvstore.pin_set import PinSet
from kvstore.sizes import parse_size
from kvstore.tenant_quota import TenantBytes, never_pinned


class BudgetError(ValueError):
    """A change of a tier's limits that was refused (what is pinned holds more than a new
    limit, or a tier whose limits kvtier does not set); nothing was changed."""


@dataclass(frozen=True)
class Limits:
    """A tier's limits after a change (None: unbounded) and the keys to evict, in eviction
    order, to meet them (`ByteBudget.plan_limits`)."""

    budget: int | None
    pin_budget: int | None
    tenant_quota: int | None
    victims: list[str] = field(default_factory=list)


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

    def usage_by(self, label: Callable[[str], str | None]) -> dict[str, tuple[int, int]]:
        """Returns per label of the keys held (`label(key)`; None: the key is not counted) its
        (entries, bytes)."""
        out: dict[str, tuple[int, int]] = {}
        for key, nbytes in self.sizes.items():
            tag = label(key)
            if tag is not None:
                n, b = out.get(tag, (0, 0))
                out[tag] = (n + 1, b + nbytes)
        return out

    def clear(self) -> None:
        for key in list(self.sizes):
            self.remove(key)

    def plan_limits(self, budget: int | None = None, pin_budget: int | None = None,
                    tenant_quota: int | None = None, *, account: tuple[int, int | None] | None = None,
                    tier: str = "tier") -> Limits:
        """Returns the limits with those given changed (None: unchanged) and the unprotected keys to evict, in
        order, to meet them; changes nothing. ValueError if malformed, BudgetError if pins hold more."""
        # An unchanged pin budget above a new budget becomes that budget. `account`: (bytes used,
        # budget) of the account the byte budget lives in when not this one (a disk directory's).
        budget = parse_size(budget, f"tier {tier}: budget")
        pin_budget = parse_size(pin_budget, f"tier {tier}: pin_budget")
        tenant_quota = parse_size(tenant_quota, f"tier {tier}: tenant_quota")
        used, old_budget = account if account is not None else (self.used, self.budget)
        new_budget = old_budget if budget is None else budget
        new_pin = self.pinned.budget if pin_budget is None else pin_budget
        if new_budget is not None and (new_pin is None or new_pin > new_budget):
            if pin_budget is not None:
                raise ValueError(f"tier {tier}: pin_budget {pin_budget} bytes is more than the tier's budget "
                                 f"({new_budget} bytes)")
            new_pin = new_budget
        quota = self.tenants.quota if tenant_quota is None else tenant_quota
        victims: list[str] = []
        if tenant_quota is not None:
            found = self.tenants.trim_victims(tenant_quota, self.sizes, self.policy.victims, self.protected)
            if found is None:
                raise BudgetError(f"tier {tier}: a tenant's pinned chunks (or chunks being loaded) hold more than "
                                  f"the tenant_quota of {tenant_quota} bytes asked; nothing was changed "
                                  "(unpin them first)")
            victims = found
        if new_budget is not None:
            chosen = set(victims)
            left = used - sum(self.sizes[v] for v in victims)
            for key in self.policy.victims() if left > new_budget else ():
                if key in chosen or self.protected(key):
                    continue
                victims.append(key)
                left -= self.sizes[key]
                if left <= new_budget:
                    break
            if left > new_budget:
                raise BudgetError(f"tier {tier}: {left} bytes cannot be evicted (pinned chunks, chunks being "
                                  f"loaded or written), more than the budget of {new_budget} bytes asked; "
                                  "nothing was changed (unpin first)")
        self.pinned.expire()
        if new_pin is not None and self.pinned.bytes > new_pin:
            raise BudgetError(f"tier {tier}: {self.pinned.bytes} bytes are pinned, more than the pin budget of "
                              f"{new_pin} bytes asked; nothing was changed (unpin first)")
        return Limits(new_budget, new_pin, quota, victims)

    def apply_limits(self, limits: Limits, *, own_budget: bool = True) -> None:
        """Sets the limits `plan_limits` returned (the byte budget only with `own_budget`); the caller
        then removes the victims under the same lock."""
        if own_budget:
            self.budget = limits.budget
        self.pinned.budget = limits.pin_budget
        self.tenants.quota = limits.tenant_quota
