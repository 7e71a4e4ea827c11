"""The storage manager: tiers ordered fast to slow behind one fetch/put interface
(docs/architecture.md, "Tiers and the storage manager").

- `batched_put` writes the fastest tier synchronously and the slower tiers through a background
  writer with a bounded queue (full queue: a write is dropped and counted, never waited for).
  A tier whose `fill` is "demote" is not written then: it gets what the tier above it (cpu or
  device) evicts, through the same writer, unless it holds it already; tiers as a hierarchy.
- `fetch` reads from the fastest tier holding a chunk and says which tier that was (it never
  promotes); `promote` writes such hits into the faster tiers (the connector does it through
  its store queue, off the load path).
- Existence: `batched_where` (the fastest tier holding each key), `batched_contains` and
  `tier_prefix_hits` (what each tier holds from the start), one batched query per tier, no
  data read.
- Each tier evicts by its own policy within its byte budget; keys held here for a load
  (kvstore/load_holds.py) are never evicted. Hold counts cannot go negative.
- A tier that raises is backed off by a circuit breaker (kvstore/health.py) and probed again
  after a cool-down; the caller only ever sees a miss (recompute), never the exception. Reads
  and writes have separate breakers: a tier refusing writes (a full Redis, a read-only
  directory) keeps serving reads. Remote tiers bound each call by a deadline
  (kvstore/deadlines.py); calls that fail or end past it are counted (`TierStats.timeouts`).
- Operating the cache (describe, pins, budgets, copies, removals) is `operations`, one service
  over the same guards (kvstore/tier_operations.py).
- `close` writes what is queued for at most `flush_timeout_s`, then drops the rest and logs how
  much, so a tier that never answers cannot hold a shutdown.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any, TypeVar, overload

import torch

from kvstore import serde
from kvstore.backend import Destination, StorageBackend, leading_run
from kvstore.background_queue import BACKGROUND_NICE, BackgroundQueue
from kvstore.capabilities import LOCAL_TIERS, EvictingTier, HandsOverEvictions, ReadsInPlace, RemoteTier
from kvstore.deadlines import BACKOFF_INITIAL_S, BACKOFF_MAX_S, FLUSH_TIMEOUT_S, CallKind
from kvstore.device_staging import stage
from kvstore.health import BREAKER_FAILURES
from kvstore.load_holds import LoadHolds
from kvstore.store_config import FILLS, KVStoreConfig
from kvstore.tier_events import TierEvents, TierListener
from kvstore.tier_guard import SKIPPED, Skipped, TierGuard
from kvstore.tier_operations import TierOperations
from kvstore.tier_stats import TierStats

logger = logging.getLogger("kvtier.kvstore")
T = TypeVar("T")



def _check_chunk(key: str, kv: Any) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"chunk key must be a non-empty str, got {key!r}")
    if not isinstance(kv, torch.Tensor):
        raise ValueError(f"chunk for {key!r} must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"chunk for {key!r} must be (layers, 2, tokens, kv_heads, head_size), got {tuple(kv.shape)}")




class StorageManager:
    """Tiers fast to slow; thread-safe. `batched_put` takes ownership of the tensor (do not mutate it later).
    `fills`: per tier, how chunks reach it (`TierSpec.fill`; default "write" for all)."""

    def __init__(self, tiers: Sequence[StorageBackend], names: Sequence[str] | None = None,
                 queue_size: int = 64, queue_full: str = "drop_oldest",
                 backoff_initial_s: float = BACKOFF_INITIAL_S, backoff_max_s: float = BACKOFF_MAX_S,
                 breaker_failures: int = BREAKER_FAILURES, flush_timeout_s: float = FLUSH_TIMEOUT_S,
                 fills: Sequence[str] | None = None) -> None:
        if not tiers:
            raise ValueError("tiers: a storage manager needs at least one tier")
        self.tiers = list(tiers)
        names = list(names) if names is not None else [f"{i}:{t.name}" for i, t in enumerate(self.tiers)]
        if len(names) != len(self.tiers):
            raise ValueError("names: one name per tier is needed")
        self.names = names
        self.fills = self._check_fills(list(fills) if fills is not None else ["write"] * len(self.tiers))
        self.holds = LoadHolds()
        self._events = TierEvents([t.name for t in self.tiers])
        for i, tier in enumerate(self.tiers):
            if isinstance(tier, EvictingTier):
                tier.set_hold_check(self.holds.is_held)
                tier.set_eviction_listener(partial(self._events.evicted, i))
        self._stats_lock = threading.Lock()
        self._guards = [TierGuard(t, n, self._stats_lock, backoff_initial_s, backoff_max_s, breaker_failures)
                        for t, n in zip(self.tiers, names)]
        self._stats = [g.counters for g in self._guards]
        self.operations = TierOperations(self._guards, self.holds, self._events, self.flush)
        self.flush_timeout_s = flush_timeout_s
        self._writer = BackgroundQueue(queue_size, queue_full, nice=BACKGROUND_NICE) if len(self.tiers) > 1 else None
        self.staging_copies = 0  # chunks copied to another device by `batched_put` (once per device)
        self._closed = False
        for i, fill in enumerate(self.fills):
            if fill == "demote":
                above = self.tiers[i - 1]
                assert isinstance(above, HandsOverEvictions)  # _check_fills
                above.set_hand_over(partial(self._demote, i))

    def _check_fills(self, fills: list[str]) -> list[str]:
        """Returns `fills` once each is known and every "demote" tier sits below one that hands
        over its evictions; raises ValueError naming the tier."""
        if len(fills) != len(self.tiers):
            raise ValueError("fills: one fill per tier is needed")
        for i, fill in enumerate(fills):
            if fill not in FILLS:
                raise ValueError(f"{self.names[i]}: unknown fill {fill!r}; choose one of {list(FILLS)}")
            if fill == "demote" and (i == 0 or not isinstance(self.tiers[i - 1], HandsOverEvictions)):
                above = "no tier is above it" if i == 0 else f"the tier above, {self.names[i - 1]}, cannot"
                raise ValueError(f"{self.names[i]}: fill=demote takes the chunks the tier above evicts, and "
                                 f"{above} (a cpu or device tier can)")
        return fills

    def _written(self, tiers: Iterable[int]) -> list[int]:
        """Returns those of `tiers` that every stored chunk is written to (fill "write")."""
        return [i for i in tiers if self.fills[i] == "write"]

    def _demote(self, i: int, items: list[tuple[str, torch.Tensor]]) -> None:
        """Queues the chunks the tier above `i` evicted for tier `i`, which stores those it does
        not hold yet (it may still hold a chunk promoted from it)."""

        def job() -> None:
            held = self._call(i, partial(self.tiers[i].batched_contains, [k for k, _ in items]), "lookup")
            todo = items if held is SKIPPED else [item for item, h in zip(items, held) if not h]
            if todo:
                self._store(i, todo, owned=True)

        self._in_background([i], job)

    @classmethod
    def from_config(cls, config: KVStoreConfig) -> StorageManager:
        """Returns a manager with one backend per configured tier (built by URL scheme). Sets
        this process's K/V integrity key to `config.integrity_key` (None: no MACs); the key is
        per process, so the last manager built from a config decides it."""
        from kvstore.registry import create_backend

        config.validate()
        serde.set_integrity_key(config.integrity_key)
        tiers: list[StorageBackend] = []
        try:
            for spec in config.tiers:
                tiers.append(create_backend(spec))
        except BaseException:
            for tier in tiers:
                tier.close()
            raise
        try:
            manager = cls(tiers, names=[f"{i}:{s.url}" for i, s in enumerate(config.tiers)],
                          queue_size=config.queue_size, queue_full=config.queue_full,
                          backoff_initial_s=config.backoff_initial_s, backoff_max_s=config.backoff_max_s,
                          breaker_failures=config.breaker_failures, flush_timeout_s=config.flush_timeout_s,
                          fills=[s.fill for s in config.tiers])
        except BaseException:
            for tier in tiers:
                tier.close()
            raise
        manager._check_tiers()
        return manager

    def set_listener(self, listener: TierListener) -> None:
        """Tells `listener` the keys each tier stored (after the write), evicted, or deleted
        through `delete`; it runs on the writing thread, sometimes under a tier's lock, so it
        must be quick and must not call the tiers."""
        self._events.listener = listener

    def _check_tiers(self) -> list[str]:
        """Asks every tier once whether it answers; returns the names of those that do not.
        Each unreachable tier gets one warning naming it and starts out backing off (its reads
        and writes are misses until a retry reaches it), so requests do not warn again."""
        down = []
        for i, tier in enumerate(self.tiers):
            if not isinstance(tier, RemoteTier):
                continue  # a local tier answers whenever its process runs
            try:
                tier.check()
            except Exception as exc:
                logger.warning("kvstore tier %s is unreachable (%s: %s); it is skipped (a miss, so requests "
                               "recompute) and retried after a backoff",
                               self.names[i], type(exc).__name__, exc)
                self._guards[i].unreachable(exc)
                down.append(self.names[i])
        return down

    # -- guarded tier calls --------------------------------------------------------------
    def _call(self, i: int, fn: Callable[[], T], kind: CallKind) -> T | Skipped:
        """Returns fn()'s result on tier i, or SKIPPED (its breaker is open, or the call failed)."""
        return self._guards[i].call(fn, kind)

    def _store(self, i: int, items: Sequence[tuple[str, torch.Tensor]], owned: bool = False) -> None:
        accepted = self._guards[i].store(items, owned)
        if accepted is not SKIPPED:
            self._events.stored(i, [k for (k, _), ok in zip(items, accepted) if ok])

    def _store_slow(self, tiers: Sequence[int], items: Sequence[tuple[str, torch.Tensor]]) -> None:
        if not tiers:
            return

        def job() -> None:
            for i in tiers:
                self._store(i, items)

        self._in_background(tiers, job)

    def _in_background(self, tiers: Sequence[int], job: Callable[[], None]) -> None:
        """Queues `job`, writes to `tiers` (never the fastest: there is a writer), on the background
        writer; a job the full queue drops is counted against each of them."""
        assert self._writer is not None
        if not self._writer.submit(job):
            with self._stats_lock:
                for i in tiers:
                    self._stats[i].dropped_writes += 1

    # -- public interface ----------------------------------------------------------------
    def batched_put(self, items: Sequence[tuple[str, torch.Tensor]], *, owned: bool = False) -> None:
        """Stores every chunk in every tier it is written to (not those filled by demotion): the
        fastest now, the rest in the background.
        Raises ValueError for a malformed chunk (storing nothing).
        `owned`: the tensors are handed over (never modified again), so a memory tier may keep
        them without a copy. A chunk on another device than a tier's (a GPU gather, host tiers)
        is copied there once, and that one copy feeds every tier on that device."""
        items = list(items)
        for key, kv in items:
            _check_chunk(key, kv)
        if not items:
            return
        staged, copies = stage(items, {t.device for t in self.tiers})
        if copies:
            with self._stats_lock:
                self.staging_copies += copies
        first = staged[self.tiers[0].device]
        self._store(0, first, owned or first is not items)
        slow = self._written(range(1, len(self.tiers)))
        for device in {self.tiers[i].device for i in slow}:
            self._store_slow([i for i in slow if self.tiers[i].device == device], staged[device])

    def tier_prefix_hits(self, keys: Sequence[str]) -> dict[str, int]:
        """Returns, per tier name (fastest first), how many of `keys` from the start that tier
        holds by itself: one batched existence query per tier, no data read (a tier backing
        off answers 0)."""
        keys = list(keys)
        hits: dict[str, int] = {}
        for i, tier in enumerate(self.tiers):
            got = self._call(i, partial(tier.batched_contains, keys), "lookup") if keys else []
            hits[self.names[i]] = 0 if got is SKIPPED else leading_run(got)
        return hits

    def batched_where(self, keys: Sequence[str]) -> list[int | None]:
        """Returns, per key, the index (in `names`) of the fastest tier holding it, None where
        none does: one batched query per tier, asking each only for the keys not found yet
        (tiers backing off count as holding nothing)."""
        keys = list(keys)
        where: list[int | None] = [None] * len(keys)
        for i, tier in enumerate(self.tiers):
            todo = [j for j, w in enumerate(where) if w is None]
            if not todo:
                break
            got = self._call(i, partial(tier.batched_contains, [keys[j] for j in todo]), "lookup")
            if got is not SKIPPED:
                for j, present in zip(todo, got):
                    if present:
                        where[j] = i
        return where

    def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        """Returns, per key, whether some tier holds it (`batched_where`)."""
        return [w is not None for w in self.batched_where(keys)]

    def is_local(self, name: str) -> bool:
        """Returns whether the tier named `name` lives in this process's memory (`LOCAL_TIERS`)."""
        return self.tiers[self.names.index(name)].name in LOCAL_TIERS

    def tier_get(self, name: str, key: str) -> torch.Tensor | None:
        """Returns the value the tier named `name` holds under `key` (the caller's own), or
        None (absent, or the tier backing off or failing)."""
        i = self.names.index(name)
        got = self._call(i, partial(self.tiers[i].batched_get, [key]), "load")
        return None if got is SKIPPED else got[0]

    def tier_put(self, name: str, key: str, value: torch.Tensor) -> bool:
        """Stores `value` under `key` in the tier named `name` alone, now (not through the
        background writer); returns whether it was accepted."""
        _check_chunk(key, value)
        i = self.names.index(name)
        if not self.tiers[i].exact and not value.is_floating_point():
            return False  # a lossy codec takes floating-point K/V only
        got = self._call(i, partial(self.tiers[i].batched_put, [(key, value)]), "write")
        return got is not SKIPPED and bool(got[0])

    @property
    def reads_in_place(self) -> bool:
        """Whether `fetch(into=...)` can read chunks straight into memory: the fastest tier
        can, and only from it (a hit below it is promoted, so it is read into memory it keeps)."""
        first = self.tiers[0]
        return isinstance(first, ReadsInPlace) and first.reads_in_place

    @overload
    def fetch(self, keys: Sequence[str], *, read_only: bool = ...,
              into: None = ..., held: bool = ...) -> list[tuple[torch.Tensor | None, int]]: ...
    @overload
    def fetch(self, keys: Sequence[str], *, read_only: bool = ...,
              into: Sequence[Destination], held: bool = ...) -> list[tuple[torch.Tensor | Destination | None, int]]: ...

    def fetch(self, keys: Sequence[str], *, read_only: bool = False, into: Sequence[Destination] | None = None,
              held: bool = False
              ) -> list[tuple[torch.Tensor | Destination | None, int]] | list[tuple[torch.Tensor | None, int]]:
        """Returns per key (the chunk from the fastest tier holding it, that tier's index) or
        (None, -1); promotes nothing (see `promote`). Keys are held while they load (`held`:
        the caller holds them already, `hold`, for longer). A chunk
        lives where its tier keeps chunks (GPU for `device`, else CPU) and is the caller's own
        (a copy, or a fresh decode), unless `read_only`: the caller never modifies the results,
        so memory tiers return their tensors without copying them. `into` (one per key): the
        fastest tier reads chunks it can straight into them (`reads_in_place`); each comes back
        as its destination."""
        keys = list(keys)
        out: list[tuple[torch.Tensor | Destination | None, int]] = [(None, -1)] * len(keys)
        if not held:
            self.holds.hold(keys)
        try:
            missing = list(range(len(keys)))
            for i, tier in enumerate(self.tiers):
                if not missing:
                    break
                want = [keys[j] for j in missing]
                t0 = time.perf_counter()
                got: Sequence[torch.Tensor | Destination | None] | Skipped
                if i == 0 and into is not None and isinstance(tier, ReadsInPlace) and tier.reads_in_place:
                    got = self._call(i, partial(tier.batched_read_into, want, [into[j] for j in missing]), "load")
                else:
                    got = self._call(i, partial(tier.batched_get, want, read_only=read_only), "load")
                if got is SKIPPED:
                    continue
                elapsed = time.perf_counter() - t0
                nbytes = 0
                still: list[int] = []
                for j, kv in zip(missing, got):
                    if kv is None:
                        still.append(j)
                    else:
                        out[j] = (kv, i)
                        nbytes += kv.nbytes
                with self._stats_lock:
                    s = self._stats[i]
                    s.hits += len(missing) - len(still)
                    s.misses += len(still)
                    s.bytes_loaded += nbytes
                    s.load_seconds += elapsed
                missing = still
        finally:
            if not held:
                self.holds.release(keys)
        return out

    def promote(self, items: Sequence[tuple[str, torch.Tensor, int]], *, owned: bool = True) -> None:
        """Writes each `(key, chunk, tier)` from `fetch` into the tiers faster than `tier` it would
        have been written to: the fastest now, the others through the background writer (a
        tier filled by demotion gets it when the tier above evicts it). `owned` as in `batched_put`."""
        by_tier: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for key, kv, tier in items:
            by_tier.setdefault(tier, []).append((key, kv))
        for tier, found in sorted(by_tier.items()):
            if tier > 0:
                self._store(0, found, owned=owned)
                self._store_slow(self._written(range(1, tier)), found)

    def hold(self, keys: Iterable[str]) -> None:
        """Holds chunks for a load (e.g. between a prefix lookup and their load): no tier evicts
        them until they are released."""
        self.holds.hold(keys)

    def release(self, keys: Iterable[str]) -> None:
        """Releases load holds; raises ValueError if a key is not held (counts never go negative)."""
        self.holds.release(keys)

    def delete(self, key: str) -> None:
        """Removes `key` from every healthy tier (slow tiers after queued writes)."""
        self.flush()
        for i, tier in enumerate(self.tiers):
            if self._call(i, partial(tier.delete, key), "write") is True:
                self._events.removed(i, [key])

    def clear(self, local_only: bool = False) -> None:
        """Removes every chunk each healthy tier owns (see each tier's `clear`); with
        `local_only`, only the tiers in this process's memory (LOCAL_TIERS), whose chunks no
        other process reads."""
        self.flush()
        for i, tier in enumerate(self.tiers):
            if not local_only or tier.name in LOCAL_TIERS:
                if self._call(i, tier.clear, "write") is not SKIPPED:
                    self._events.cleared(i)

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until background writes are done; returns False on timeout."""
        return self._writer.flush(timeout) if self._writer else True

    def stats(self) -> dict[str, TierStats]:
        """Returns a snapshot of per-tier counters keyed by tier name."""
        return {self.names[i]: guard.snapshot() for i, guard in enumerate(self._guards)}

    def writer_stats(self) -> dict[str, int]:
        """Returns the background writer's pending, done and dropped job counts."""
        if self._writer is None:
            return {"pending": 0, "done": 0, "dropped": 0}
        return {"pending": self._writer.pending(), "done": self._writer.done, "dropped": self._writer.dropped}

    def close(self, timeout: float | None = None) -> int:
        """Writes what the background writer holds for at most `timeout` seconds (None: this
        manager's `flush_timeout_s`), drops what is left (logged), and closes every tier.
        Returns how many queued writes were dropped; a write still running past the bound is
        left to its thread (it never holds the process: the thread is a daemon)."""
        if self._closed:
            return 0
        self._closed = True
        dropped = 0
        if self._writer:
            bound = self.flush_timeout_s if timeout is None else max(0.0, timeout)
            dropped = self._writer.close(bound)
            stuck = self._writer.pending()
            if dropped or stuck:
                logger.warning("kvstore: the shutdown flush ran out of time (flush_timeout_s=%g): %d queued "
                               "write(s) to the slower tiers dropped, %d still running abandoned",
                               self.flush_timeout_s, dropped, stuck)
        for tier in self.tiers:
            try:
                tier.close()
            except Exception:
                logger.exception("closing tier failed")
        return dropped

    def __enter__(self) -> StorageManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
