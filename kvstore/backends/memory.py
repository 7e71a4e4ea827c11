"""In-process tiers: `device` (GPU memory when CUDA is present) and `cpu` (pinned host memory
when CUDA is present). Same code path on a CPU-only machine.

With the `raw` codec chunks are kept as tensors (a get is one copy); other codecs keep the
serde-encoded value, e.g. `int8` to fit twice as many chunks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

from kvkeys.stored_keys import UsageGroup, is_chunk_key, usage_group
from kvstore import serde
from kvstore.backend import BackendStats, EntryInfo, StorageBackend
from kvstore.budget import ByteBudget
from kvstore.capabilities import EvictingTier, HandsOverEvictions, OperatedTier, PrefixDeletable
from kvstore.codecs import Buffer, Codec, QuantCodec, get_codec, host_copy
from kvstore.eviction import DEFAULT_POLICY, make_policy
from kvstore.pin_set import default_pin_budget
from kvstore.store_config import TierSpec


def _stored_nbytes(value: torch.Tensor | Buffer) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return len(value)


def _whole_tensor(kv: torch.Tensor, device: torch.device) -> bool:
    """Whether `kv` is contiguous on `device` and spans its whole storage, so keeping it keeps
    exactly its own bytes alive (a view of something larger would hide memory from the budget)."""
    return (kv.device == device and kv.is_contiguous()
            and kv.untyped_storage().nbytes() == kv.numel() * kv.element_size())


class MemoryBackend(StorageBackend, EvictingTier, HandsOverEvictions, OperatedTier, PrefixDeletable):
    """Chunks held in this process's memory on `device`, within a hard byte budget; the
    operator's pins within `pin_budget` (None: half the byte budget, kvstore/pin_set.py)."""

    name = "memory"

    def __init__(self, device: torch.device | str = "cpu", byte_budget: int | None = None,
                 codec: Codec | str = "raw", eviction: str = DEFAULT_POLICY, pin_memory: bool = False,
                 tenant_quota: int | None = None, pin_budget: int | None = None) -> None:
        self.device = torch.device(device)
        self.codec = get_codec(codec) if isinstance(codec, str) else codec
        self.exact = not isinstance(self.codec, QuantCodec)
        self.pin_memory = pin_memory and self.device.type == "cpu" and torch.cuda.is_available()
        self._budget = ByteBudget(byte_budget, make_policy(eviction), tenant_quota,
                                  pin_budget if pin_budget is not None else default_pin_budget(byte_budget))
        self._store: dict[str, torch.Tensor | Buffer] = {}
        self._lock = threading.Lock()
        self._stats = BackendStats(byte_budget=byte_budget)
        self._on_hand_over: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None

    def set_hand_over(self, on_evict: Callable[[list[tuple[str, torch.Tensor]]], None]) -> None:
        self._on_hand_over = on_evict

    def set_hold_check(self, is_held: Callable[[str], bool]) -> None:
        self._budget.is_pinned = is_held

    def _copy(self, kv: torch.Tensor) -> torch.Tensor:
        """Returns a contiguous copy of `kv` on this tier's device."""
        if self.device.type == "cpu":
            return host_copy(kv)
        return kv.detach().to(self.device, copy=True).contiguous()

    def _to_stored(self, key: str, kv: torch.Tensor, owned: bool = False) -> torch.Tensor | Buffer:
        if self.codec.name != "raw":
            return serde.encode(key, kv, self.codec)
        if owned and _whole_tensor(kv, self.device) and (not self.pin_memory or kv.is_pinned()):
            return kv.detach()  # e.g. the storage manager's (pinned) staging copy: kept as is
        if self.pin_memory:
            out = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
            return out.copy_(kv, non_blocking=False)
        # a copy: the caller's tensor may be a view into the engine's kv cache that changes later
        return self._copy(kv)

    def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key in self._store for key in keys]

    def _lookup(self, key: str) -> torch.Tensor | Buffer | None:
        """Returns the stored value of `key` (counting the hit or miss and touching it)."""
        with self._lock:
            value = self._store.get(key)
            if value is None:
                self._stats.misses += 1
                return None
            self._budget.touch(key)
            self._stats.hits += 1
            return value

    def batched_get(self, keys: Sequence[str], *, read_only: bool = False) -> list[torch.Tensor | None]:
        """Returns per key a copy of the chunk (on this tier's device for raw; with `read_only`
        the stored tensor itself), a fresh decode for other codecs, or None on a miss."""
        out: list[torch.Tensor | None] = []
        for key in keys:
            value = self._lookup(key)
            # stored values are never mutated in place (a put replaces them), so copy outside the lock
            if value is None or (read_only and isinstance(value, torch.Tensor)):
                out.append(value)
            elif isinstance(value, torch.Tensor):
                out.append(self._copy(value))
            else:
                out.append(serde.decode(key, value).to(self.device))
        return out

    def batched_put(self, items: Sequence[tuple[str, torch.Tensor]], *, owned: bool = False) -> list[bool]:
        """Stores a copy of each chunk (with `owned`, the tensor itself when it is a whole
        contiguous tensor on this tier's device: raw codec, pinned if this tier pins), evicting
        by policy; False per chunk that cannot fit (refused, counted)."""
        return [self._put(key, self._to_stored(key, kv, owned)) for key, kv in items]

    def _put(self, key: str, stored: torch.Tensor | Buffer) -> bool:
        nbytes = _stored_nbytes(stored)
        with self._lock:
            victims = self._budget.plan(key, nbytes)
            if victims is None:
                self._stats.rejected += 1
                return False
            gone = self._evict(victims)
            self._store[key] = stored
            self._budget.add(key, nbytes)
            self._stats.puts += 1
        self._let_go(gone)
        return True

    def _evict(self, victims: list[str]) -> list[tuple[str, torch.Tensor | Buffer]]:
        """Removes `victims` as evicted (counted) and returns them with their stored values; the
        caller holds the lock, then calls `_let_go` outside it."""
        gone = []
        for victim in victims:
            value = self._store.pop(victim, None)
            self._budget.remove(victim)
            self._stats.evictions += 1
            if value is not None:
                gone.append((victim, value))
        return gone

    def _let_go(self, gone: list[tuple[str, torch.Tensor | Buffer]]) -> None:
        """Tells the eviction listener the keys evicted and hands their chunks over (decoded, for
        codecs other than raw) when a callback takes them (`HandsOverEvictions`)."""
        self._evicted([key for key, _ in gone])
        if gone and self._on_hand_over is not None:
            self._on_hand_over([(key, value if isinstance(value, torch.Tensor) else serde.decode(key, value))
                                for key, value in gone])

    def delete(self, key: str) -> bool:
        with self._lock:
            self._budget.remove(key)
            return self._store.pop(key, None) is not None

    def clear(self) -> None:
        with self._lock:
            self._store.clear()
            self._budget.clear()

    def delete_prefix(self, prefix: str) -> int:
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix")
        with self._lock:
            keys = [k for k in self._store if k.startswith(prefix)]
            for key in keys:
                self._budget.remove(key)
                del self._store[key]
        return len(keys)

    # -- operating the cache ------------------------------------------------------------------
    def describe(self, keys: Sequence[str]) -> list[EntryInfo | None]:
        now = time.time()
        out: list[EntryInfo | None] = []
        with self._lock:
            for key in keys:
                nbytes = self._budget.sizes.get(key)
                if nbytes is None:
                    out.append(None)
                    continue
                stored, used = self._budget.times.get(key, (now, now))
                pin = self._budget.pinned.info(key)
                out.append(EntryInfo.held(nbytes, now - stored, now - used, pin))
        return out

    def usage(self) -> dict[UsageGroup, tuple[int, int]]:
        with self._lock:
            return self._budget.usage_by(usage_group)

    def pin(self, keys: Sequence[str], ttl_s: float | None = None) -> int:
        with self._lock:
            return self._budget.pinned.pin_held(keys, self._budget.sizes, ttl_s, self.name)

    def unpin(self, keys: Sequence[str]) -> int:
        with self._lock:
            return self._budget.pinned.unpin(keys)

    def set_budget(self, byte_budget: int | None = None, pin_budget: int | None = None,
                   tenant_quota: int | None = None) -> None:
        """Changes the limits given (None: unchanged), evicting LRU chunks (never pinned) to meet them
        before it returns; BudgetError or ValueError: nothing changed (`ByteBudget.plan_limits`)."""
        with self._lock:
            limits = self._budget.plan_limits(byte_budget, pin_budget, tenant_quota, tier=self.name)
            self._budget.apply_limits(limits)
            self._stats.byte_budget = limits.budget
            gone = self._evict(limits.victims)
        self._let_go(gone)

    def delete_idle(self, older_than_s: float) -> int:
        cutoff = time.time() - older_than_s
        with self._lock:
            idle = [k for k, (_, used) in self._budget.times.items()
                    if used <= cutoff and is_chunk_key(k) and not self._budget.protected(k)]
            for key in idle:
                self._budget.remove(key)
                del self._store[key]
        return len(idle)

    def stats(self) -> BackendStats:
        with self._lock:
            s = BackendStats(**vars(self._stats))
            s.entries, s.bytes_used = len(self._store), self._budget.used
            s.can_pin, s.pinned_entries = True, len(self._budget.pinned)
            s.pinned_bytes, s.pin_budget = self._budget.pinned.bytes, self._budget.pinned.budget
            return s

    def close(self) -> None:
        self.clear()


class DeviceBackend(MemoryBackend):
    """GPU memory when CUDA is present (option `device`, default cuda), else CPU memory."""

    name = "device"

    @classmethod
    def from_spec(cls, spec: TierSpec) -> DeviceBackend:
        device = spec.options.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(device=device, byte_budget=spec.budget, codec=spec.codec, eviction=spec.eviction,
                   tenant_quota=spec.tenant_quota, pin_budget=spec.pin_budget)


class CPUBackend(MemoryBackend):
    """Host memory, pinned when CUDA is present (fast, async copies to the GPU)."""

    name = "cpu"

    @classmethod
    def from_spec(cls, spec: TierSpec) -> CPUBackend:
        pin = bool(spec.options.get("pin_memory", True))
        return cls(device="cpu", byte_budget=spec.budget, codec=spec.codec, eviction=spec.eviction, pin_memory=pin,
                   tenant_quota=spec.tenant_quota, pin_budget=spec.pin_budget)
