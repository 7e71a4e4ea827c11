"""Per-tenant byte quotas inside one tier: the one home of who holds how many bytes and which of
a tenant's own entries make room when it is at its quota.

A tenant is the tag in a salted key's prefix (kvkeys/tenants.py); unsalted keys belong to
no tenant and only the tier's own budget bounds them. The quota is the same for every tenant of
the tier (`tenant_quota` in its spec). A tenant at its quota evicts its own least recently used
entries, never another tenant's: the tier's budget (kvstore/budget.py) is applied after this.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Generic, TypeVar

K = TypeVar("K", str, bytes)


def never_pinned(key: object) -> bool:
    return False


class TenantBytes(Generic[K]):
    """Bytes per tenant tag and the quota each may hold (None: no quota). Keys are the tier's
    own: `tenant_of` reads the tag from one (kvkeys/tenants.py `key_tenant`, or
    `key_tenant_bytes` for the cache server's byte keys).

    Not thread-safe on its own: its owner (a ByteBudget under its tier's lock, or the cache
    server's event loop) serialises the calls.
    """

    def __init__(self, quota: int | None, tenant_of: Callable[[K], str | None]) -> None:
        if quota is not None and (isinstance(quota, bool) or not isinstance(quota, int) or quota < 0):
            raise ValueError(f"tenant_quota must be a byte count >= 0, got {quota!r}")
        self.quota = quota
        self.tenant_of: Callable[[K], str | None] = tenant_of
        self.used: dict[str, int] = {}

    def record(self, key: K, delta: int) -> None:
        """Adds `delta` bytes to the tenant `key` names (nothing for an unsalted key)."""
        tag = self.tenant_of(key)
        if tag is None or delta == 0:
            return
        left = self.used.get(tag, 0) + delta
        if left:
            self.used[tag] = left
        else:
            self.used.pop(tag, None)

    def own_victims(self, key: K, nbytes: int, sizes: Mapping[K, int], order: Callable[[], Iterable[K]],
                    is_pinned: Callable[[K], bool] = never_pinned) -> list[K] | None:
        """Returns the entries of `key`'s tenant to evict (in `order()`, the tier's eviction
        order, called only when some must go; never pinned ones, never `key`) so that storing
        `key` with `nbytes` keeps the tenant within its quota; [] when no quota applies; None
        when it cannot fit (larger than the quota, or only pinned entries of the tenant are
        left). Changes nothing."""
        tag = self.tenant_of(key)
        if self.quota is None or tag is None:
            return []
        if nbytes > self.quota:
            return None
        free = self.quota - self.used.get(tag, 0) + sizes.get(key, 0)
        victims: list[K] = []
        if free >= nbytes:
            return victims
        for victim in order():
            if victim == key or self.tenant_of(victim) != tag or is_pinned(victim):
                continue
            victims.append(victim)
            free += sizes[victim]
            if free >= nbytes:
                return victims
        return None

    def trim_victims(self, quota: int, sizes: Mapping[K, int], order: Callable[[], Iterable[K]],
                     is_pinned: Callable[[K], bool] = never_pinned) -> list[K] | None:
        """Returns the entries to evict (in `order()`, never pinned ones) so every tenant holds at most
        `quota` bytes (a quota lowered at run time); None when pinned ones alone hold more."""
        over = {tag: used - quota for tag, used in self.used.items() if used > quota}
        victims: list[K] = []
        for key in order() if over else ():
            tag = self.tenant_of(key)
            if tag is None or tag not in over or is_pinned(key):
                continue
            victims.append(key)
            over[tag] -= sizes[key]
            if over[tag] <= 0:
                del over[tag]
                if not over:
                    break
        return None if over else victims
