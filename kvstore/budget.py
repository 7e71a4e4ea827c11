"""Byte accounting for one tier: sizes, an eviction policy, a hard byte budget, and the
operator's pins (kvstore/pin_set.py) with their own budget. The limits may change at run time
(`plan_limits`, `apply_limits`: `POST /kv/budget`), the tier evicting at once to meet them.

The one home of which keys are held, how many bytes each, in what eviction order, which are
protected, who is over its tenant quota and which victims make room: the cpu and device tiers
(kvstore/backends/memory.py), the disk tier, the redis tier, and the cache server's memory
(kvstore/cache_server/store.py) and disk spill (kvstore/cache_server/spill.py) each hold one. The cache
server's keys are bytes (`tenant_of`, `pin_name`); what else an owner counts (bodies in flight,
values being sent or spilled, files being read) stays with that owner."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

from kvkeys.tenants import key_tenant
from kvstore.eviction import EvictionPolicy, K, make_policy
from kvstore.pin_set import PinSet
from kvstore.sizes import parse_size
from kvstore.tenant_quota import TenantBytes, never_pinned

G = TypeVar("G", bound=Hashable)  # what usage is counted by


def sum_usage(counts: Iterable[tuple[G, tuple[int, int]]]) -> dict[G, tuple[int, int]]:
    """Returns the (entries, bytes) of `counts` summed per label: the one way usage is added up
    (a tier's keys, a server's memory and disk, a tier's groups per tenant or model)."""
    out: dict[G, tuple[int, int]] = {}
    for label, (n, b) in counts:
        n0, b0 = out.get(label, (0, 0))
        out[label] = (n0 + n, b0 + b)
    return out


class BudgetError(ValueError):
    """A change of a tier's limits that was refused (what is pinned holds more than a new
    limit, or a tier whose limits kvtier does not set); nothing was changed."""


@dataclass(frozen=True)
class Limits(Generic[K]):
    """A tier's limits after a change (None: unbounded) and the keys to evict, in eviction
    order, to meet them (`ByteBudget.plan_limits`)."""

    budget: int | None
    pin_budget: int | None
    tenant_quota: int | None
    victims: list[K] = field(default_factory=list)


_STR_TENANT: Callable[[Any], str | None] = key_tenant  # a tier's keys: str, named as they are


def _same_name(key: Any) -> str:
    return str(key)


class ByteBudget(Generic[K]):
    """Tracks `key -> stored bytes` of a tier and picks victims so that `used <= budget` always,
    and, with a `tenant_quota`, every tenant's bytes <= the quota (its own entries evicted first).

    Not thread-safe on its own: the owning tier calls it under its lock. `is_pinned` is set by
    the owner (the storage manager's keys being loaded; the cache server's operator pins, which
    span its memory and its disk); `pinned` holds the operator's pins (at most `pin_budget`
    bytes, None: no bound; keyed by `pin_name(key)`); a key pinned either way is never chosen as
    a victim, and a key removed loses its `pinned` pin. `times` keeps each key's (stored, last
    used) wall-clock times, for inspection.

    Keys are str (a tier's) unless `tenant_of` (the tenant tag of a key) and `pin_name` (its
    name in `pinned`) say how to read another key type (the cache server's bytes).
    """

    @overload
    def __init__(self: ByteBudget[str], budget: int | None, policy: EvictionPolicy[str] | None = None,
                 tenant_quota: int | None = None, pin_budget: int | None = None,
                 pin_clock: Callable[[], float] = time.monotonic) -> None: ...

    @overload
    def __init__(self: ByteBudget[K], budget: int | None, policy: EvictionPolicy[K] | None = None,
                 tenant_quota: int | None = None, pin_budget: int | None = None,
                 pin_clock: Callable[[], float] = time.monotonic, *,
                 tenant_of: Callable[[K], str | None], pin_name: Callable[[K], str]) -> None: ...

    def __init__(self, budget: int | None, policy: EvictionPolicy[Any] | None = None,
                 tenant_quota: int | None = None, pin_budget: int | None = None,
                 pin_clock: Callable[[], float] = time.monotonic, *,
                 tenant_of: Callable[[Any], str | None] | None = None,
                 pin_name: Callable[[Any], str] | None = None) -> None:
        if budget is not None and budget < 0:
            raise ValueError(f"byte budget must be >= 0, got {budget}")
        self.budget = budget
        self.policy: EvictionPolicy[K] = policy if policy is not None else make_policy()
        self.sizes: dict[K, int] = {}
        self.used = 0
        self.is_pinned: Callable[[K], bool] = never_pinned
        self.tenants: TenantBytes[K] = TenantBytes(tenant_quota, tenant_of if tenant_of is not None else _STR_TENANT)
        self.pin_name: Callable[[K], str] = pin_name if pin_name is not None else _same_name
        self.pinned = PinSet(pin_budget, pin_clock)  # a persisted set's clock: time.time
        self.times: dict[K, tuple[float, float]] = {}

    def protected(self, key: K) -> bool:
        """Returns whether `key` may not be evicted: being loaded, or pinned by the operator."""
        return self.is_pinned(key) or self.pinned.holds(self.pin_name(key))

    def __contains__(self, key: K) -> bool:
        return key in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def pick(self, nbytes: int, skip: Collection[K] = ()) -> tuple[list[K], int]:
        """Returns the unprotected keys (not in `skip`), in eviction order, whose bytes add up to
        at least `nbytes`, and their bytes; all of them (fewer bytes) when they do not. Changes
        nothing (but releases operator pins found expired)."""
        victims: list[K] = []
        found = 0
        if nbytes <= 0:
            return victims, found
        for victim in self.policy.order():
            if victim in skip or self.protected(victim):
                continue
            victims.append(victim)
            found += self.sizes[victim]
            if found >= nbytes:
                break
        return victims, found

    def tenant_victims(self, key: K, nbytes: int) -> list[K] | None:
        """Returns `key`'s tenant's own unprotected entries to evict, in eviction order, so that
        `key` (of `nbytes`) fits its quota (`TenantBytes.own_victims`); None if it cannot."""
        return self.tenants.own_victims(key, nbytes, self.sizes, self.policy.order, self.protected)

    def plan(self, key: K, nbytes: int) -> list[K] | None:
        """Returns the keys to evict so that `key` (of `nbytes`) fits, or None if it cannot fit
        (larger than the budget or its tenant's quota, or only pinned keys are left to evict) or
        the policy does not admit it in their place (`EvictionPolicy.admit`).
        A salted key's own tenant's entries go first, down to its quota; then the tier's
        order, down to the budget. Changes nothing (but releases operator pins found expired)."""
        victims = self.tenant_victims(key, nbytes)
        if victims is None:
            return None
        if self.budget is not None:
            if nbytes > self.budget:
                return None
            free = self.budget - self.used + self.sizes.get(key, 0) + sum(self.sizes[v] for v in victims)
            if free < nbytes:
                skip = set(victims)
                skip.add(key)
                more, found = self.pick(nbytes - free, skip)
                if free + found < nbytes:
                    return None
                victims = victims + more
        if victims and key not in self.sizes and not self.policy.admit(key):
            return None
        return victims

    def add(self, key: K, nbytes: int, times: tuple[float, float] | None = None) -> None:
        """Records `key` as stored with `nbytes` (replacing an earlier size), stored and last used
        now, or at `times` (stored, last used) when it moved here from elsewhere."""
        delta = nbytes - self.sizes.get(key, 0)
        self.used += delta
        self.tenants.record(key, delta)
        self.sizes[key] = nbytes
        self.policy.on_insert(key)
        self.pinned.resize(self.pin_name(key), nbytes)
        now = time.time()
        self.times[key] = times or (now, now)

    def remove(self, key: K) -> int:
        """Forgets `key`; returns the bytes it freed (0 if unknown)."""
        nbytes = self.sizes.pop(key, 0)
        self.used -= nbytes
        self.tenants.record(key, -nbytes)
        self.policy.on_remove(key)
        self.pinned.release(self.pin_name(key))
        self.times.pop(key, None)
        return nbytes

    def touch(self, key: K) -> None:
        if key in self.sizes:
            self.policy.on_access(key)
            self.times[key] = (self.times.get(key, (time.time(), 0.0))[0], time.time())

    def usage_by(self, label: Callable[[K], G | None]) -> dict[G, tuple[int, int]]:
        """Returns per label of the keys held (`label(key)`; None: the key is not counted) its
        (entries, bytes)."""
        return sum_usage((tag, (1, nbytes)) for key, nbytes in self.sizes.items() if (tag := label(key)) is not None)

    def clear(self) -> None:
        for key in list(self.sizes):
            self.remove(key)

    def quota_victims(self, quota: int) -> list[K] | None:
        """Returns the entries to evict, in eviction order, so every tenant holds at most `quota`
        bytes (`TenantBytes.trim_victims`), never protected ones: None when they alone hold more."""
        return self.tenants.trim_victims(quota, self.sizes, self.policy.order, self.protected)

    def plan_limits(self, budget: int | None = None, pin_budget: int | None = None,
                    tenant_quota: int | None = None, *, account: tuple[int, int | None] | None = None,
                    tier: str = "tier") -> Limits[K]:
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
        victims: list[K] = []
        if tenant_quota is not None:
            found = self.quota_victims(tenant_quota)
            if found is None:
                raise BudgetError(f"tier {tier}: a tenant's pinned chunks (or chunks being loaded) hold more than "
                                  f"the tenant_quota of {tenant_quota} bytes asked; nothing was changed "
                                  "(unpin them first)")
            victims = found
        if new_budget is not None:
            left = used - sum(self.sizes[v] for v in victims)
            more, found_bytes = self.pick(left - new_budget, set(victims))
            victims += more
            left -= found_bytes
            if left > new_budget:
                raise BudgetError(f"tier {tier}: {left} bytes cannot be evicted (pinned chunks, chunks being "
                                  f"loaded or written), more than the budget of {new_budget} bytes asked; "
                                  "nothing was changed (unpin first)")
        self.pinned.expire()
        if new_pin is not None and self.pinned.bytes > new_pin:
            raise BudgetError(f"tier {tier}: {self.pinned.bytes} bytes are pinned, more than the pin budget of "
                              f"{new_pin} bytes asked; nothing was changed (unpin first)")
        return Limits(new_budget, new_pin, quota, victims)

    def apply_limits(self, limits: Limits[K], *, own_budget: bool = True) -> None:
        """Sets the limits `plan_limits` returned (the byte budget only with `own_budget`); the caller
        then removes the victims under the same lock."""
        if own_budget:
            self.budget = limits.budget
        self.pinned.budget = limits.pin_budget
        self.tenants.quota = limits.tenant_quota
