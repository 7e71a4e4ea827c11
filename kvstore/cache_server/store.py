"""The cache server's in-memory LRU byte store, with optional spill to disk.

Values are opaque bytes; the server never decodes them. One memory budget (`max_bytes`)
covers every large buffer the server holds, and is never exceeded:

- stored entries: `len(key) + len(value)` each (`bytes_used`);
- bodies being received: reserved from their header before their buffer is allocated
  (`reserved`), and turned into the entry when a PUT completes;
- values being sent: a reply pins the stored buffer it sends (no copy); a pinned value that
  leaves the store (evicted, deleted, replaced) still counts (`retired`) until its last
  reply is written.

- values being spilled: an entry evicted to the disk spill stays counted (`retired`, and
  `spilling`) until the spill's worker thread has written it; a GET meanwhile takes it
  straight back into memory.

Which entries are held, their bytes, their eviction order (`eviction`, a policy of
kvstore/eviction.py), which are protected and which make room is the store's `ByteBudget`
(kvstore/budget.py, as a tier's); the other bytes above (reserved, retired, spilling, replies'
holds) are the store's own counters beside it. Making room evicts in the policy's order (to the
disk spill when there is one); a value that cannot fit at all, or that the policy does not
admit in place of others, is refused. With a `tenant_quota`,
no tenant (the tag of a salted key, kvkeys/tenants.py) holds more than that many bytes of
stored entries: a tenant at its quota evicts its own least recently used entries first,
never another tenant's (the disk spill applies the same quota to its files). Memory and disk
hold disjoint sets of keys: a GET that finds its key on disk reads it back into memory
(`load`, off the event loop).

Operator pins (PIN/UNPIN, `pins`: kvstore/pin_set.py, within `pin_budget` bytes): a pinned
entry is never evicted, neither from memory nor from the disk spill, while its pin holds;
memory keeps the pinned bytes back from the room it makes for others (so they are always
room for the pinned entries, wherever they are). An explicit removal (DELETE, DELETE_PREFIX,
CLEAR) beats a pin; an entry lost otherwise (a damaged file) loses its pin with it. With a
spill, the pins are kept in its directory across a restart (kvstore/cache_server/spill.py); after a
restart the pinned entries are on disk, never evicted there, and back in memory at their first GET.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from itertools import chain

from kvkeys.stored_keys import UsageGroup, usage_group_bytes
from kvkeys.tenants import key_tenant_bytes
from kvstore.budget import ByteBudget, sum_usage
from kvstore.cache_server.protocol import Buffer
from kvstore.cache_server.spill import DiskSpill, pin_name
from kvstore.cache_server.store_stats import StoreStats, read_stats
from kvstore.eviction import DEFAULT_POLICY, make_policy
from kvstore.pin_set import PinInfo, PinSet, default_pin_budget
from kvstore.sizes import parse_size
from kvstore.tenant_quota import TenantBytes


class ByteStore:
    """Map of byte keys to byte values within `max_bytes`, evicted in the order of the policy
    `eviction` (kvstore/eviction.py), which may also refuse a new key in place of others. Not
    thread-safe: the server touches it only from its event loop thread (the spill's completions
    run there too)."""

    def __init__(self, max_bytes: int, spill: DiskSpill | None = None, tenant_quota: int | None = None,
                 pin_budget: int | None = None, eviction: str = DEFAULT_POLICY) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        budget = default_pin_budget(max_bytes) if pin_budget is None else pin_budget
        if budget is None or not 0 <= budget <= max_bytes:
            raise ValueError(f"pin_budget must be 0..max_bytes ({max_bytes}), got {budget}")
        if spill is not None and spill.tenants.quota != tenant_quota:
            raise ValueError(f"the disk spill's tenant quota ({spill.tenants.quota}) differs from "
                             f"memory's ({tenant_quota})")
        self.max_bytes = max_bytes
        self.spill = spill
        # The stored entries' bytes (key + value, or the whole file buffer of one read from
        # disk), their eviction order, tenants and victims; the bound is max_bytes over more
        # than these (`committed`), so the budget itself is unbounded.
        self.budget: ByteBudget[bytes] = ByteBudget(None, make_policy(eviction), tenant_quota,
                                                    tenant_of=key_tenant_bytes, pin_name=pin_name)
        self.budget.is_pinned = self._pinned
        self.tenant_evictions = 0
        self.hits = self.misses = self.puts = self.evictions = self.rejected = 0
        self.disk_hits = 0
        self.reserved = 0  # bytes committed to bodies being received
        self.retired = 0  # bytes of values gone from the store that replies still send
        self.pinned_stored = 0  # bytes of stored entries that replies are sending (not evictable room)
        self.spilling = 0  # bytes of retired values that pending spill writes hold (room once written)
        self._spilling: dict[int, object] = {}  # id(value) -> token of the write that frees it
        self.on_freed: Callable[[], None] | None = None  # told when spill completions free budget
        # Disk reads waiting for memory: key -> (file size, callbacks of the GETs asking)
        self._loads: dict[bytes, tuple[int, list[Callable[[Buffer | None], None]]]] = {}
        self._values: dict[bytes, Buffer] = {}  # the stored entries (their order: `budget`)
        # id(value) -> [replies (and spill writes) holding it, bytes it holds, whether it has left the store]
        self._pins: dict[int, list[int]] = {}
        # The operator's pins (names: spill.pin_name), the spill's when there is one (loaded
        # from its directory); this budget replaces the last run's, over it the newest go.
        self.pins = spill.pins if spill is not None else PinSet(None, time.time)
        self.pins.budget = budget
        self.pins.trim()
        self._pins_saved = -1 if spill is not None and spill.pin_file.size else self.pins.changes
        self._save_pins()

    @property
    def memory_entries(self) -> int:
        """Entries held in memory (not on the disk spill)."""
        return len(self._values)

    @property
    def bytes_used(self) -> int:
        """Bytes of the stored entries."""
        return self.budget.used

    @property
    def tenants(self) -> TenantBytes[bytes]:
        return self.budget.tenants

    def __len__(self) -> int:
        return len(self._values) + (len(self.spill) if self.spill is not None else 0)

    def fits(self, key_len: int, value_len: int) -> bool:
        """Returns whether an entry of these sizes can be stored in memory at all."""
        return key_len + value_len <= self.max_bytes

    @property
    def committed(self) -> int:
        """Bytes the budget covers now: stored + reserved for bodies + retired but sending."""
        return self.bytes_used + self.reserved + self.retired

    def _room(self) -> int:
        # What eviction can make free: the rest is held by bodies in flight and by values
        # replies are sending (evicting those frees nothing until the reply is written).
        # Values being spilled free their bytes once written: they count as room.
        # Operator pins keep their bytes back (their entries are never evicted, wherever they are).
        self.pins.expire()
        return self.max_bytes - self.reserved - (self.retired - self.spilling) - self.pinned_stored - self.pins.bytes

    def can_make_room(self, n: int, own_pin: int = 0) -> bool:
        """Returns whether evicting (and waiting for spill writes) can make `n` bytes free,
        i.e. they are not held by bodies in flight, replies being sent and operator pins
        (`own_pin`: the bytes kept back for the entry these are for, pinned on disk)."""
        return n <= self._room() + own_pin

    def reserve(self, n: int, own_pin: int = 0) -> bool:
        """Commits `n` bytes for a body about to be received, evicting LRU entries to make
        room; returns False while bodies in flight, replies being sent, operator pins (but
        `own_pin`, as in can_make_room) and spill writes still pending leave less than `n`
        (evicting nothing in the first three cases). Guarantees committed <= max_bytes."""
        if n > self._room() + own_pin:
            return False
        self._make_room(n)
        if self.committed + n > self.max_bytes:
            return False  # evicted entries are still being written to disk
        self.reserved += n
        return True

    def release(self, n: int) -> None:
        """Returns `n` reserved bytes whose body was dropped or consumed without being stored."""
        self.reserved -= n
        if n:
            self._freed()

    def pin(self, key: bytes, value: Buffer) -> None:
        """Marks `value`, just returned by get(key), as being sent: it stays counted (and
        resident) until `unpin`, even if it leaves the store meanwhile."""
        entry = self._pins.get(id(value))
        if entry is not None:
            entry[0] += 1
            return
        size = self.budget.sizes[key]
        self._pins[id(value)] = [1, size, 0]
        self.pinned_stored += size

    def unpin(self, value: Buffer) -> bool:
        """Ends one reply's hold on `value`; returns whether budget was freed by it (the
        value had left the store and this was its last reply)."""
        entry = self._pins[id(value)]
        entry[0] -= 1
        if entry[0]:
            return False
        del self._pins[id(value)]
        if entry[2]:
            self.retired -= entry[1]
            return True
        self.pinned_stored -= entry[1]
        return False

    def put(self, key: bytes, value: Buffer, reserved: int = 0) -> bool:
        """Stores `value` (kept by reference, not copied), consuming `reserved` bytes reserved
        for its body; returns False if it does not fit (never, or not while replies and
        bodies in flight hold the rest). Guarantees committed <= max_bytes afterwards."""
        size = len(key) + len(value)
        self.reserved -= reserved
        own_pin = self._pin_bytes(key)  # a pinned key stored again keeps its pin, at its new size
        new = key not in self.budget
        self._remove(key)
        if self.spill is not None:
            self.spill.delete(key)  # memory and disk hold disjoint keys
        if size > self._room() + own_pin or not self._make_tenant_room(key, size):
            self.rejected += 1
            return False
        if new and self._over(size) > 0 and not self.budget.policy.admit(key):
            self.rejected += 1  # the policy keeps what it holds (an admission filter)
            return False
        self._make_room(size)
        if self.committed + size > self.max_bytes:
            return False  # room comes when queued spill writes finish (the server reserves first)
        self._hold(key, value, size)
        self.puts += 1
        return True

    def get(self, key: bytes) -> Buffer | None:
        """Returns the value held in memory (promoted to most recently used; a value still
        being written to the disk spill is taken back), or None: then it may be on disk
        (`load`, which counts the hit or miss)."""
        value = self._values.get(key)
        if value is not None:
            self.budget.touch(key)
            self.hits += 1
            return value
        if self.spill is not None:
            value = self.spill.take(key)
            if value is not None:
                self._reclaim(key, value)
                self.hits += 1
                return value
        return None

    def load(self, key: bytes, done: Callable[[Buffer | None], None]) -> bool:
        """Reads `key` back from the disk spill (or joins the read under way); returns
        False on a miss. Otherwise `done(value)` runs later with the value, now in memory,
        or None (damaged, deleted or replaced meanwhile, or memory held by replies and
        bodies in flight). Call after get() returned None."""
        spill = self.spill
        if spill is None or key not in spill:
            self.misses += 1
            return False
        if spill.reading(key):
            spill.read(key, lambda value: self._count_load(value, done))
            return True
        waiting = self._loads.get(key)
        if waiting is not None:
            waiting[1].append(done)
            return True
        size = spill.detach(key)  # its disk space may take the spills that make room for it
        if not size:
            self.misses += 1
            return False
        self._loads[key] = (size, [done])
        self._try_load(key)
        return True

    @property
    def loads_waiting(self) -> int:
        """Disk reads waiting for memory (retry_loads when memory frees)."""
        return len(self._loads)

    def retry_loads(self) -> None:
        """Starts the disk reads that were waiting for memory and now fit."""
        for key in list(self._loads):
            self._try_load(key)

    def _try_load(self, key: bytes) -> None:
        size, waiters = self._loads[key]
        spill = self.spill
        assert spill is not None
        own_pin = self._pin_bytes(key)
        if spill.detached(key) and self.can_make_room(size, own_pin):
            # The file is read into a buffer of its size: commit that first.
            if not self.reserve(size, own_pin):
                return  # room comes when the spill writes just queued are done
            del self._loads[key]
            spill.read(key, lambda value: self._loaded(key, size, value, waiters))
            return
        # Deleted, replaced or cleared meanwhile; or replies and bodies in flight hold the
        # memory: then the entry stays on disk and these GETs miss.
        del self._loads[key]
        spill.restore(key)
        if key not in spill:  # the disk had no room to keep it again: the entry is lost, with its pin
            self.pins.release(pin_name(key))
            self._save_pins()
        for done in waiters:
            self._count_load(None, done)

    def _loaded(self, key: bytes, size: int, value: memoryview | None,
                waiters: list[Callable[[Buffer | None], None]]) -> None:
        self.reserved -= size
        # Stale (a PUT or DELETE of the key meanwhile), damaged, or (a quota lowered since it
        # was written) larger than its tenant's quota: a miss, and the entry is gone.
        if value is None or not self._make_tenant_room(key, size):
            value = None
            self._freed()
        else:
            # The buffer is the whole file (>= key + value): its reserved room becomes the entry.
            self._hold(key, value, size)
            self.disk_hits += 1
        for done in waiters:
            self._count_load(value, done)

    def _count_load(self, value: Buffer | None, done: Callable[[Buffer | None], None]) -> None:
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
        done(value)

    def contains(self, key: bytes) -> bool:
        """Returns whether `key` is held in memory or on disk (touches no LRU order)."""
        return key in self._values or (self.spill is not None and key in self.spill)

    def prefix_hits(self, keys: Sequence[bytes]) -> int:
        """Returns how many of `keys`, counted from the start, are held."""
        n = 0
        for key in keys:
            if not self.contains(key):
                break
            n += 1
        return n

    def delete(self, key: bytes) -> bool:
        """Removes `key` from memory and disk, with its pin; returns whether it was present."""
        found = self._delete(key)
        self._save_pins()
        return found

    def _delete(self, key: bytes) -> bool:
        in_memory = self._remove(key)
        on_disk = self.spill.delete(key) if self.spill is not None else False
        self.pins.release(pin_name(key))
        return in_memory or on_disk

    def delete_prefix(self, prefix: bytes) -> int:
        """Removes every key starting with `prefix` from memory and disk, with their pins;
        returns how many."""
        keys = {k for k in self._values if k.startswith(prefix)}
        if self.spill is not None:
            keys.update(self.spill.keys_with_prefix(prefix))
        removed = sum(self._delete(k) for k in keys)
        self._save_pins()
        return removed

    def clear(self) -> None:
        """Empties memory now, and the disk spill (its files are removed in the background);
        every pin is released."""
        for key in list(self._values):
            self._remove(key)
        if self.spill is not None:
            self.spill.clear()
        self.pins.clear()
        self._save_pins()

    # -- operator pins ----------------------------------------------------------------------
    def pin_keys(self, keys: Sequence[bytes], ttl_s: float | None = None) -> int:
        """Pins every key held (in memory or on disk) against eviction, all or none, within
        the pin budget; returns the bytes newly pinned. PinError (nothing pinned) when a key
        is not held or the pins would pass the budget."""
        self._drop_lost_pins()
        held: dict[str, int] = {}
        for key in keys:
            size = self.budget.sizes.get(key) or (self.spill.size_of(key) if self.spill is not None else None)
            if size:
                held[pin_name(key)] = size
        added = self.pins.pin_held([pin_name(k) for k in keys], held, ttl_s, "cache server")
        self._save_pins()
        return added

    def unpin_keys(self, keys: Sequence[bytes]) -> int:
        """Releases the operator pins of `keys`; returns how many were pinned."""
        released = self.pins.unpin(pin_name(k) for k in keys)
        self._save_pins()
        return released

    def describe_keys(self, keys: Sequence[bytes]) -> list[tuple[int, PinInfo | None] | None]:
        """Returns per key (its bytes, in memory or on disk, and its pin or None), or None
        when it is not held."""
        out: list[tuple[int, PinInfo | None] | None] = []
        for key in keys:
            size = self.budget.sizes.get(key) or (self.spill.size_of(key) if self.spill is not None else None)
            out.append(None if not size else (size, self.pins.info(pin_name(key))))
        return out

    def _pin_bytes(self, key: bytes) -> int:
        """Returns the bytes `key`'s operator pin keeps back (0: not pinned)."""
        info = self.pins.info(pin_name(key))
        return 0 if info is None else info.nbytes

    def _drop_lost_pins(self) -> None:
        """Releases the pins of keys held neither in memory nor on disk (a damaged file, a
        write that failed)."""
        for name in self.pins.keys():
            if not self.contains(name.encode("latin-1")):
                self.pins.release(name)
        self._save_pins()

    def _save_pins(self) -> None:
        """Has the spill write the pins when they changed since last written."""
        if self.spill is not None and self.pins.changes != self._pins_saved:
            self._pins_saved = self.pins.changes
            self.spill.save_pins()

    def flush_to_disk(self, stall_timeout: float | None = None) -> int:
        """Writes every in-memory entry to the disk spill (most recent last, so that the
        disk LRU keeps the hottest), waits for every queued write (or, with `stall_timeout`,
        until the disk has made no progress for that long), and stops the spill's worker;
        returns how many entries this wrote. Used at shutdown so a restart with the same
        --disk keeps the data, and a stuck disk never hangs the shutdown."""
        if self.spill is None:
            return 0
        written: list[bool] = []
        for key in self.budget.policy.order():
            self.spill.put(key, self._values[key], written.append)
        self._drop_lost_pins()  # and saves what changed unsaved (expiries, sizes), after the writes
        self.spill.close(stall_timeout)
        return sum(written)

    def set_limits(self, max_bytes: int | None = None, tenant_quota: int | None = None) -> None:
        """Sets the memory budget and/or tenant quota (None: unchanged) and evicts (in the policy's
        order, spilled if a spill) to meet them now, never a pinned entry; ValueError, nothing
        changed, if malformed, below what is in flight, or a quota below what one tenant's pinned
        entries hold."""
        # A lowered quota evicts each tenant's own entries past it, in memory and on the spill;
        # an entry being spilled stays counted until written, as after any eviction.
        max_bytes, tenant_quota = parse_size(max_bytes, "max_bytes"), parse_size(tenant_quota, "tenant_quota")
        if max_bytes is not None:
            held = self.reserved + (self.retired - self.spilling) + self.pinned_stored
            if max_bytes == 0 or held > max_bytes:
                raise ValueError(f"max_bytes {max_bytes}: must be > 0 and at least the {held} bytes bodies in "
                                 "flight and replies being sent hold now; nothing was changed")
        if tenant_quota is not None:
            victims = self.budget.quota_victims(tenant_quota)  # never a pinned entry
            if victims is None:
                raise ValueError(f"tenant_quota {tenant_quota}: a tenant's pinned entries hold more than that; "
                                 "nothing was changed (unpin them first)")
            self.tenants.quota = tenant_quota
            if self.spill is not None:
                self.spill.set_tenant_quota(tenant_quota)
            for victim in victims:
                self.tenant_evictions += 1
                self._evict(victim, self._values.pop(victim))
        if max_bytes is not None:
            self.max_bytes = max_bytes
            self._make_room(0)

    def stats(self) -> StoreStats:
        """Returns what STATS reports of this store and its disk spill."""
        self._drop_lost_pins()
        return read_stats(self)

    def usage(self, prefix: bytes = b"") -> dict[UsageGroup, tuple[int, int]]:
        """Returns per (tenant, key family) of the chunks held in memory and on disk whose keys
        start with `prefix` their (entries, bytes) (kvkeys/stored_keys.py)."""
        def group(key: bytes) -> UsageGroup | None:
            return usage_group_bytes(key) if key.startswith(prefix) else None

        on_disk = self.spill.index.usage_by(group) if self.spill is not None else {}
        return sum_usage(chain(self.budget.usage_by(group).items(), on_disk.items()))

    def delete_idle(self, older_than_s: float) -> int:
        """Removes every chunk (never a pinned one, nor a key naming no chunk) not used for
        `older_than_s` seconds, from memory and disk (a spilled chunk keeps its last use; one
        found on disk at startup was last used then); returns how many."""
        cutoff = time.time() - older_than_s
        held = [self.budget.times, self.spill.index.times] if self.spill is not None else [self.budget.times]
        idle = {k for times in held for k, (_, used) in times.items()
                if used <= cutoff and usage_group_bytes(k) is not None and not self._pinned(k)}
        removed = sum(self._delete(k) for k in idle)
        self._save_pins()
        return removed

    def tenant_bytes(self) -> dict[str, int]:
        """Returns the bytes of stored entries in memory per tenant tag (salted keys only)."""
        return dict(self.tenants.used)

    def _hold(self, key: bytes, value: Buffer, size: int) -> None:
        self._values[key] = value
        self.budget.add(key, size)
        self.pins.resize(pin_name(key), size)  # a pinned entry stored again, or read back from disk

    def _pinned(self, key: bytes) -> bool:
        return self.pins.holds(pin_name(key))

    def _make_tenant_room(self, key: bytes, size: int) -> bool:
        """Evicts `key`'s tenant's own least recently used entries (never pinned ones) until
        `size` more bytes fit in its quota; returns False (evicting nothing) when they cannot."""
        victims = self.budget.tenant_victims(key, size)
        if victims is None:
            return False
        for victim in victims:
            self.tenant_evictions += 1
            self._evict(victim, self._values.pop(victim))
        return True

    def _remove(self, key: bytes) -> bool:
        value = self._values.pop(key, None)
        if value is None:
            return False
        self._forget(key, value)
        return True

    def _forget(self, key: bytes, value: Buffer) -> None:
        self.budget.remove(key)
        entry = self._pins.get(id(value))
        if entry is not None:  # still being sent: its bytes stay counted until then
            entry[2] = 1
            self.pinned_stored -= entry[1]
            self.retired += entry[1]

    def _over(self, n: int) -> int:
        """Returns the bytes to evict before `n` more fit once queued spill writes finish (<= 0: none)."""
        return self.committed - self.spilling + n - self.max_bytes

    def _make_room(self, n: int) -> None:
        """Evicts entries (in the budget's order, never pinned ones) until `n` more bytes fit
        once queued spill writes finish (callers check _room() first, so the entries that
        replies are sending, which free nothing, never leave it short)."""
        while (over := self._over(n)) > 0:
            # an entry a reply is sending frees nothing until written (without a spill): ask again
            victims, _ = self.budget.pick(over)
            if not victims:
                return
            for key in victims:
                value = self._values.pop(key, None)
                if value is not None:  # (not gone meanwhile through a completion run inline)
                    self._evict(key, value)

    def _evict(self, key: bytes, value: Buffer) -> None:
        """Evicts an entry just taken out of the LRU: to the disk spill, else dropped."""
        self.evictions += 1
        if self.spill is None:
            self._forget(key, value)
        else:
            self._spill(key, value)

    def _spill(self, key: bytes, value: Buffer) -> None:
        # The write holds the buffer like a reply does: its bytes stay counted until written.
        size, times = self.budget.sizes[key], self.budget.times.get(key)
        self.pin(key, value)
        self._forget(key, value)
        token = object()
        self._spilling[id(value)] = token
        self.spilling += size
        assert self.spill is not None
        if not self.spill.put(key, value, lambda _ok: self._spilled(value, size, token), times):
            self._spilled(value, size, token)  # larger than the whole disk budget: dropped

    def _spilled(self, value: Buffer, size: int, token: object) -> None:
        if self._spilling.get(id(value)) is token:
            del self._spilling[id(value)]
            self.spilling -= size
        if self.unpin(value):
            self._freed()

    def _reclaim(self, key: bytes, value: Buffer) -> None:
        """Puts back a value whose spill write was cancelled: retired becomes stored again
        (the write still holds it until its completion runs). It fit its tenant's quota when
        stored, so its tenant can always make room; were it not so, it would stay retired and
        leave with the write."""
        entry = self._pins[id(value)]
        size = entry[1]
        if not self._make_tenant_room(key, size):
            return
        if self._spilling.pop(id(value), None) is not None:
            self.spilling -= size
        entry[2] = 0
        self.retired -= size
        self.pinned_stored += size
        self._hold(key, value, size)

    def _freed(self) -> None:
        if self.on_freed is not None:
            self.on_freed()
