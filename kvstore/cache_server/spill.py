"""The cache server's disk spill: one file per entry, LRU within its own byte budget.

The index (which keys have a file, their sizes, the eviction order, the disk budget and tenant
quota) is a `ByteBudget` (kvstore/budget.py) over the files, like the tiers'; what only the spill
has (writes pending, reads under way, detached keys) stays beside it here.

The index (which keys are on disk, and the disk budget) lives on the event loop's thread;
every file operation runs on one worker thread (`io_worker.IOWorker`), in the order the loop
issued them, so a slow or stalled disk never stalls a client. Files and directories:
`spillfile.py`, over the file-per-entry layer the disk tier uses too (kvstore/entry_files/).

- `put` queues a write: the key counts as on disk at once, while the write is pending its
  value is still in memory (`take` hands it back, so a GET of a value being spilled is
  answered from memory), and `done(ok)` tells the store when the buffer is no longer held.
- `detach` takes a key out of the disk budget while memory is made for it, then `read`
  queues a read that also removes the file (memory and disk hold disjoint keys); GETs of a
  key being read join that read.
- `clear` forgets every entry at once and switches to a new generation directory; the old
  one is removed by a second thread, so neither the loop nor later spills wait for it.

With a tenant quota, no tenant (the tag of a salted key) holds more than that many bytes of
files: a tenant at its quota evicts its own least recently used files first.

The server's operator pins (`pins`, kvstore/pin_set.py: PIN/UNPIN) are kept beside the spill's
generations (`DIR/.kvtier-pins`, kvstore/pin_file.py): loaded at startup, before the startup
eviction, and written by the worker after each change (`save_pins`), so a restart with the same
directory keeps them. A pinned key's file is never evicted (`protected`); a write that only
pinned files stand in the way of is refused (the entry is dropped, as one larger than the budget).

The directory is a cache, never a reason to stop serving: when it stops accepting writes
(read-only, full) the failure is logged once per episode and evicted entries are dropped.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from kvkeys.tenants import key_tenant_bytes
from kvstore.budget import ByteBudget
from kvstore.cache_server import spillfile as F
from kvstore.cache_server.io_worker import IOWorker
from kvstore.cache_server.protocol import Buffer
from kvstore.entry_files.entry_scan import remove
from kvstore.eviction import make_policy
from kvstore.pin_file import PIN_FILE, PinFile
from kvstore.pin_set import PinSet
from kvstore.tenant_quota import TenantBytes

log = logging.getLogger(__name__)


def pin_name(key: bytes) -> str:
    """Returns the name `key` has in the server's pin set (latin-1: one character per byte, so
    any key round-trips through the pin file's JSON)."""
    return key.decode("latin-1")


@dataclass(eq=False)
class _Write:
    key: bytes
    value: Buffer
    path: Path
    size: int
    cancelled: bool = False  # read by the worker: a write not started yet is skipped


@dataclass(eq=False)
class _Read:
    key: bytes
    path: Path
    size: int
    waiters: list[Callable[[memoryview | None], None]] = field(default_factory=list)
    stale: bool = False  # the key was deleted, replaced or cleared meanwhile


class DiskSpill:
    """Entries evicted from memory, kept on disk until their own LRU evicts them.

    Call its methods from one thread only (the server's event loop); `attach` routes the
    worker's completions there.
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int, tenant_quota: int | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_disk_bytes must be positive, got {max_bytes}")
        self.tenant_evictions = 0
        self.root = Path(directory)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        # the files (written or being written): their sizes, LRU first; the disk budget, the tenant quota
        self.index = self._new_index(tenant_quota)
        self.evictions = 0
        self.corrupt = 0
        self.write_failures = 0
        self._failing = False  # the last write or removal failed (logged once per episode)
        self._writing: dict[bytes, _Write] = {}
        self._reading: dict[bytes, _Read] = {}
        self._detached: dict[bytes, int] = {}  # key -> file size: out of the budget, read next
        self.worker = IOWorker("kvtier-spill")
        self.janitor = IOWorker("kvtier-spill-clear")  # removes cleared generations
        # Startup (before serving): reuse the newest generation, remove the older ones.
        gens = F.generations(self.root)
        self.generation = gens[-1] if gens else 0
        self.dir = F.generation_dir(self.root, self.generation)
        self.dir.mkdir(exist_ok=True)
        for old in gens[:-1]:
            self.janitor.submit(partial(F.remove_tree, F.generation_dir(self.root, old)))
        for entry in F.scan(self.dir):
            self._add(entry.key, entry.size)
        # the pins kept by the last run (the store sets their budget); of keys still on disk
        self.pins = PinSet(None, time.time)
        self.pin_file = PinFile(self.root / PIN_FILE)
        self.pin_file.refresh(self.pins, self._on_disk)
        self._evict_to(self.max_bytes)
        self._evict_over_quota()  # a restart with a smaller quota

    def _new_index(self, tenant_quota: int | None) -> ByteBudget[bytes]:
        index: ByteBudget[bytes] = ByteBudget(self.max_bytes, make_policy(), tenant_quota,
                                              tenant_of=key_tenant_bytes, pin_name=pin_name)
        index.is_pinned = self.protected  # the server's pins (`pins`), which span memory and disk
        return index

    @property
    def bytes_used(self) -> int:
        """File sizes of the entries in the index (written or being written)."""
        return self.index.used

    @property
    def tenants(self) -> TenantBytes[bytes]:
        return self.index.tenants

    def _on_disk(self, name: str) -> bool:
        try:
            return name.encode("latin-1") in self.index
        except UnicodeEncodeError:  # no key of ours (a foreign pin file's)
            return False

    def protected(self, key: bytes) -> bool:
        """Returns whether `key` is pinned by the operator (its file is never evicted)."""
        return self.pins.holds(pin_name(key))

    def save_pins(self) -> None:
        """Queues a write of the pin set as it is now to the pin file (in order with the other
        file operations); a failure is logged, the pins stay in memory."""
        data = self.pins.to_json()
        self.worker.submit(partial(_write_pins, self.pin_file, data), self._pins_written)

    def _pins_written(self, error: OSError | None) -> None:
        if error is not None:
            log.error("disk spill %s cannot write its pin file (%s): pins changed since are not "
                      "kept across a restart until a later write succeeds", self.root, error)

    def attach(self, wake: Callable[[Callable[[], None]], object]) -> None:
        """Has completions run through `wake` (the event loop's call_soon_threadsafe)."""
        self.worker.wake = wake
        self.worker.run_completions()

    def __len__(self) -> int:
        return len(self.index) + len(self._reading) + len(self._detached)

    def __contains__(self, key: bytes) -> bool:
        return key in self.index or key in self._reading or key in self._detached

    def _path(self, key: bytes) -> Path:
        return self.dir / F.file_name(key)

    def put(self, key: bytes, value: Buffer, done: Callable[[bool], None],
            times: tuple[float, float] | None = None) -> bool:
        """Queues a write of `value` under `key` (stored and last used at `times`, default now),
        evicting LRU files first; returns False
        (queuing nothing, and `done` is never called) if the entry alone exceeds the disk
        budget or its tenant's quota. Otherwise `done(written)` runs on this thread once the
        worker no longer holds `value` (written, failed, or cancelled by `take`/`delete`/`clear`)."""
        size = F.file_size(len(key), len(value))
        self.delete(key)
        if size > self.max_bytes or not self._make_tenant_room(key, size):
            return False
        if not self._evict_to(self.max_bytes - size):
            return False  # only pinned files left to evict
        job = _Write(key, value, self._path(key), size)
        self._add(key, size, times)
        self._writing[key] = job
        self.worker.submit(lambda: _run_write(job), lambda error: self._written(job, error, done))
        return True

    def _written(self, job: _Write, error: OSError | None, done: Callable[[bool], None]) -> None:
        ok = error is None and not job.cancelled
        if self._writing.get(job.key) is job:
            del self._writing[job.key]
            if not ok:  # the entry is not on disk after all
                self._take_out(job.key)
        if error is not None:
            self._write_failed(error)
        elif ok:
            self._failing = False
        done(ok)

    def take(self, key: bytes) -> Buffer | None:
        """Returns the value of `key` if its write is still pending (removing the entry from
        disk: the caller keeps it in memory again), else None."""
        job = self._writing.get(key)
        if job is None:
            return None
        self.delete(key)
        return job.value

    def detach(self, key: bytes) -> int:
        """Takes `key` out of the disk budget ahead of reading it (its file stays until the
        read), so that spills made to free memory for it may use its space; returns its
        file size (what reading it allocates), or 0 if it is not on disk or is being
        written (then `take` answers from memory). A detached key is still held: `read`
        it, or `restore` it."""
        size = self._detached.get(key)
        if size is not None:
            return size
        if key in self._reading or key in self._writing or key not in self.index:
            return 0
        size = self._take_out(key)
        self._detached[key] = size
        return size

    def detached(self, key: bytes) -> bool:
        """Returns whether `key` is still detached (not deleted, replaced or cleared)."""
        return key in self._detached

    def restore(self, key: bytes) -> None:
        """Puts a detached key back under the disk budget (most recently used)."""
        size = self._detached.get(key)
        if size is None:
            return
        if not self._make_tenant_room(key, size) or not self._evict_to(self.max_bytes - size):
            self.delete(key)  # larger than its tenant's quota (set lower since), or only pinned files left
            return
        del self._detached[key]
        self._add(key, size)

    def size_of(self, key: bytes) -> int | None:
        """Returns the file size of `key` if this spill holds it (written, being written or
        read, detached), else None."""
        size = self.index.sizes.get(key) or self._detached.get(key)
        if size is None and key in self._reading:
            size = self._reading[key].size
        return size

    def reading(self, key: bytes) -> bool:
        return key in self._reading

    def read(self, key: bytes, done: Callable[[memoryview | None], None]) -> bool:
        """Reads a detached `key`, whose file then leaves the disk (memory and disk hold
        disjoint keys), or joins the read of `key` under way; returns False (and `done` is
        never called) if it is neither. `done(value)` runs on this thread when read: None
        if damaged, or if the key was deleted, replaced or cleared meanwhile."""
        pending = self._reading.get(key)
        if pending is not None:
            pending.waiters.append(done)
            return True
        size = self._detached.pop(key, None)
        if size is None:
            return False
        job = _Read(key, self._path(key), size, [done])
        self._reading[key] = job
        self.worker.submit(lambda: F.take(job.path, key, size), lambda value: self._read_done(job, value))
        return True

    def _read_done(self, job: _Read, value: memoryview | None) -> None:
        if self._reading.get(job.key) is job:
            del self._reading[job.key]
        if value is None and not job.stale:
            self.corrupt += 1
        result = None if job.stale else value
        for done in job.waiters:
            done(result)

    def keys_with_prefix(self, prefix: bytes) -> list[bytes]:
        """Returns the keys starting with `prefix` this spill holds (written, being written or
        read, detached)."""
        keys = self.index.sizes.keys() | self._writing.keys() | self._reading.keys() | self._detached.keys()
        return [k for k in keys if k.startswith(prefix)]

    def delete(self, key: bytes) -> bool:
        """Removes `key` (its file is removed in order after any pending I/O on it);
        returns whether it was present."""
        read = self._reading.pop(key, None)
        if read is not None:
            read.stale = True  # the read removes the file itself
        write = self._writing.pop(key, None)
        if write is not None:
            write.cancelled = True
        size = self._take_out(key) if key in self.index else None
        detached = self._detached.pop(key, None) is not None
        if size is None and not detached:
            return read is not None
        path = self._path(key)
        self.worker.submit(lambda: remove(path), self._unlinked)
        return True

    def _unlinked(self, error: OSError | None) -> None:
        if error is not None:
            self._write_failed(error)

    def clear(self) -> None:
        """Forgets every entry now and starts a new generation directory (one mkdir here, so
        a restart after a crash never sees the cleared entries); the old directory is
        removed in the background, after the writes already queued (which are cancelled)."""
        for read in self._reading.values():
            read.stale = True
        for write in self._writing.values():
            write.cancelled = True
        # Hand the index over whole (O(1)): only a fallback on the worker walks it.
        forgotten = (self.index.sizes, self._detached)
        self.index, self._detached = self._new_index(self.index.tenants.quota), {}
        self._reading.clear()
        self._writing.clear()
        old, new = self.dir, F.generation_dir(self.root, self.generation + 1)
        try:
            new.mkdir(exist_ok=True)
        except OSError as exc:  # read-only or full: stay, and remove the files one by one
            self._write_failed(exc)
            self.worker.submit(lambda: _unlink_all(old, [k for keys in forgotten for k in keys]), self._unlinked)
            return
        self.generation += 1
        self.dir = new
        janitor = self.janitor
        self.worker.submit(lambda: janitor.submit(partial(F.remove_tree, old)))

    def flush(self) -> None:
        """Blocks until every queued file operation is done and its completion has run."""
        self.worker.drain()

    def close(self, stall_timeout: float | None = None) -> bool:
        """Finishes the queued writes (not the background removal of cleared generations,
        which a restart completes) and stops both threads; returns whether every write ran.
        With `stall_timeout`, gives up once the disk has finished no job for that long,
        logging how many were left (a restart finds the entries that were written)."""
        drained = self.worker.close(stall_timeout)
        self.janitor.stop()
        if not drained:
            log.error("disk spill %s: the disk finished nothing for %s s; stopping with %d queued "
                      "operations undone (entries already written are kept)", self.root, stall_timeout,
                      self.worker.pending)
        return drained

    def _write_failed(self, exc: OSError) -> None:
        """Counts a failed write or removal; logs the first of a run of them, so a directory
        that turned read-only or full is reported once, not per entry."""
        self.write_failures += 1
        if not self._failing:
            self._failing = True
            log.error("disk spill %s stopped accepting writes (%s): evicted entries are dropped, "
                      "memory keeps serving", self.root, exc)

    def _add(self, key: bytes, size: int, times: tuple[float, float] | None = None) -> None:
        self.index.add(key, size, times)

    def _take_out(self, key: bytes) -> int:
        """Removes `key` from the index (not its file); returns its size."""
        return self.index.remove(key)

    def _make_tenant_room(self, key: bytes, size: int) -> bool:
        """Evicts `key`'s tenant's own least recently used files until `size` more bytes fit
        in its quota; returns False (evicting nothing) when they cannot."""
        victims = self.index.tenant_victims(key, size)
        if victims is None:
            return False
        for victim in victims:
            self.delete(victim)
            self.evictions += 1
            self.tenant_evictions += 1
        return True

    def set_tenant_quota(self, quota: int) -> None:
        """Sets the tenant quota at run time; each tenant's least recently used files past it
        are removed now (queued for the worker)."""
        self.tenants.quota = quota
        self._evict_over_quota()

    def _evict_over_quota(self) -> None:
        """Removes each tenant's least recently used files past its quota (a restart with a
        smaller quota, or one set lower at run time)."""
        quota = self.tenants.quota
        if quota is None:
            return
        for key in self.index.quota_victims(quota) or []:
            self.delete(key)
            self.evictions += 1
            self.tenant_evictions += 1

    def _evict_to(self, limit: int) -> bool:
        """Evicts least recently used files, never a pinned one, until `limit` bytes hold the
        rest; returns whether they do."""
        victims, _ = self.index.pick(self.bytes_used - limit)
        for key in victims:
            self.delete(key)
            self.evictions += 1
        return self.bytes_used <= limit


def _run_write(job: _Write) -> OSError | None:
    """Worker side of `put`: returns the error of a failed write (None if written or skipped)."""
    if job.cancelled:
        return None
    try:
        F.write(job.path, job.key, job.value)
    except OSError as exc:
        return exc
    return None


def _write_pins(pin_file: PinFile, data: bytes) -> OSError | None:
    """Worker side of `save_pins`: returns the error of a failed write (None if written)."""
    try:
        pin_file.write(data)
    except OSError as exc:
        return exc
    return None


def _unlink_all(directory: Path, keys: list[bytes]) -> OSError | None:
    """Worker side of a clear that could not switch directories: returns the first error."""
    first = None
    for key in keys:
        error = remove(directory / F.file_name(key))
        first = first or error
    return first
