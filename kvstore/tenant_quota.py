"""Per-tenant byte quotas inside one tier: the one home of who holds how many bytes and which of
a tenant's own entries make room when it is at its quota.

A tenant is the tag in a salted key's prefix (kvstore/tenant_keys.py); unsalted keys belong to
no tenant and only the tier's own budget bounds them. The quota is the same for every tenant of
the tier (`tenant_quota` in its spec). A tenant at its quota evicts its own least recently used
entries, never another tenant's: the tier's budget (kvstore/budget.py) is applied after this.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from kvstore.tenant_keys import key_tenant


class TenantBytes:
    """Bytes per tenant tag and the quota each may hold (None: no quota).

    Not thread-safe on its own: the owning ByteBudget is used under its tier's lock.
    """

    def __init__(self, quota: int | None) -> None:
        if quota is not None and (isinstance(quota, bool) or not isinstance(quota, int) or quota < 0):
            raise ValueError(f"tenant_quota must be a byte count >= 0, got {quota!r}")
        self.quota = quota
        self.used: dict[str, int] = {}

    def record(self, key: str, delta: int) -> None:
        """Adds `delta` bytes to the tenant `key` names (nothing for an unsalted key)."""
        tag = key_tenant(key)
        if tag is None or delta == 0:
            return
        left = self.used.get(tag, 0) + delta
        if left:
            self.used[tag] = left
        else:
            self.used.pop(tag, None)

    def own_victims(self, key: str, nbytes: int, sizes: Mapping[str, int], order: Callable[[], Iterable[str]],
                    is_pinned: Callable[[str], bool]) -> list[str] | None:
        """Returns the entries of `key`'s tenant to evict (in `order()`, the tier's eviction
        order, called only when some must go; never pinned ones, never `key`) so that storing
        `key` with `nbytes` keeps the tenant within its quota; [] when no quota applies; None
        when it cannot fit (larger than the quota, or only pinned entries of the tenant are
        left). Changes nothing."""
        tag = key_tenant(key)
        if self.quota is None or tag is None:
            return []
        if nbytes > self.quota:
            return None
        free = self.quota - self.used.get(tag, 0) + sizes.get(key, 0)
        victims: list[str] = []
        if free >= nbytes:
            return victims
        for victim in order():
            if victim == key or key_tenant(victim) != tag or is_pinned(victim):
                continue
            victims.append(victim)
            free += sizes[victim]
            if free >= nbytes:
                return victims
        return None
