"""What the cache server's STATS op reports of its store (as JSON), and how it is read."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

from kvstore.cache_server.spill import DiskSpill
from kvstore.pin_set import PinSet
from kvstore.tenant_quota import TenantBytes


class _Counted(Protocol):
    """What STATS reads of the store (kvstore/cache_server/store.py `ByteStore`)."""

    spill: DiskSpill | None
    pins: PinSet
    max_bytes: int
    hits: int
    misses: int
    puts: int
    evictions: int
    rejected: int
    disk_hits: int
    reserved: int
    retired: int
    spilling: int
    tenant_evictions: int

    @property
    def memory_entries(self) -> int: ...

    @property
    def bytes_used(self) -> int: ...

    @property
    def tenants(self) -> TenantBytes[bytes]: ...


@dataclass
class StoreStats:
    """What STATS reports (as JSON)."""

    entries: int
    bytes: int
    max_bytes: int
    hits: int
    misses: int
    puts: int
    evictions: int
    rejected: int
    disk_entries: int
    disk_bytes: int
    max_disk_bytes: int
    disk_hits: int
    disk_evictions: int
    disk_corrupt: int
    disk_write_failures: int
    reserved_bytes: int
    pinned_bytes: int
    spilling_bytes: int
    tenant_quota: int  # 0: none
    tenant_evictions: int  # entries (memory and disk) evicted to keep a tenant within its quota
    pin_entries: int  # operator pins (PIN) held now
    pin_bytes: int  # their bytes, never above pin_budget
    pin_budget: int  # --pin-budget

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def read_stats(store: _Counted) -> StoreStats:
    """Returns the STATS figures of `store` (memory) and its disk spill, if any."""
    spill = store.spill
    return StoreStats(
        entries=store.memory_entries,
        bytes=store.bytes_used,
        max_bytes=store.max_bytes,
        hits=store.hits,
        misses=store.misses,
        puts=store.puts,
        evictions=store.evictions,
        rejected=store.rejected,
        disk_entries=len(spill) if spill is not None else 0,
        disk_bytes=spill.bytes_used if spill is not None else 0,
        max_disk_bytes=spill.max_bytes if spill is not None else 0,
        disk_hits=store.disk_hits,
        disk_evictions=spill.evictions if spill is not None else 0,
        disk_corrupt=spill.corrupt if spill is not None else 0,
        disk_write_failures=spill.write_failures if spill is not None else 0,
        reserved_bytes=store.reserved,
        pinned_bytes=store.retired - store.spilling,
        spilling_bytes=store.spilling,
        tenant_quota=store.tenants.quota or 0,
        tenant_evictions=store.tenant_evictions + (spill.tenant_evictions if spill is not None else 0),
        pin_entries=len(store.pins),
        pin_bytes=store.pins.bytes,
        pin_budget=store.pins.budget or 0,
    )
