"""The `disk` tier (`DiskBackend`): one file per chunk under a directory (`disk:///path`), the
value placed so its payload is cache-line aligned (file_format.py). It owns this process's
index of the directory's files (their eviction order) and every change to the directory;
the names it uses are file_names.py's, the shared account dir_account.py's, and a file's
bytes are read by file_io.py. Files are created, written, renamed, opened and listed through
the file-per-entry layer the cache server's spill uses too (kvstore/entry_files/): a link, a
FIFO or a directory at a chunk's name is never followed, opened or indexed (a miss).

Writes go to a temporary file, optionally fsync'd, then atomically renamed into place, so a
reader never sees a partial value and a crash leaves only a stray temp file (removed later).
Reads touch mtime (best effort), so the LRU order survives restarts.

The byte budget is a property of the directory, held across processes: every process using
the directory keeps its accounting in one state file (`.kvtier-dir`: bytes used, budget),
changed only under an exclusive `flock` of that file. A write reserves its bytes there before
its temp file is written (temp files count), evicting least recently used files (any
process's) until the reservation fits. The process that opened the directory last sets its
budget. Temp files are named `.tmp-<pid>-<bytes>-<id>`, so a recount (on open, and whenever
a write does not fit) keeps the reservations of live writers and removes dead writers' files.

Operator pins are a property of the directory too (kvstore/pin_file.py, `.kvtier-pins`: key ->
bytes and wall-clock expiry, with the pin budget), so a restarted process keeps them and every
process using the directory honours them: each re-reads the file (when its stat changed) under
the directory's lock before it evicts, pins or unpins, and writes it back, under the same lock,
whenever its pins changed (pinned, unpinned, expired, or their files removed). The file exists
once something was pinned; it carries the pin budget of the last process that opened the
directory or pinned first, which every process then checks pins against.

A directory that cannot be written (a read-only mount of a pre-warmed cache, another user's
files) is served read-only: reads work, writes (and pins) raise BackendError.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote, urlsplit

import torch

from kvkeys.stored_keys import UsageGroup, is_chunk_key, usage_group
from kvkeys.tenants import key_tenant, tenant_prefix
from kvstore import serde
from kvstore.backend import BackendError, BackendStats, BytesBackend, Destination, EntryInfo, ReadValue, StoredValue
from kvstore.backends.disk.dir_account import STATE_BYTES, STATE_FILE, DirAccount, DirState
from kvstore.backends.disk.file_format import file_parts
from kvstore.backends.disk.file_io import read_in_place, read_value
from kvstore.backends.disk.file_names import (
    SUFFIX,
    TEMP_PREFIX,
    file_key,
    key_path,
    keys_with_prefix,
    live_reservation,
    temp_path,
    tenant_temp_names,
)
from kvstore.budget import ByteBudget
from kvstore.capabilities import EvictingTier, OperatedTier, PrefixDeletable, ReadsInPlace
from kvstore.codecs import Codec
from kvstore.entry_files import entry_scan
from kvstore.entry_files.atomic_write import create_temp, discard, install, write_parts
from kvstore.entry_files.entry_reads import NotRegularFile, open_regular, regular_size
from kvstore.eviction import DEFAULT_POLICY, make_policy
from kvstore.pin_file import PIN_FILE, PinFile
from kvstore.pin_set import PinError, default_pin_budget
from kvstore.read_buffers import ReadBufferPool
from kvstore.store_config import TierSpec

__all__ = ["DiskBackend"]

log = logging.getLogger(__name__)


class DiskBackend(BytesBackend, EvictingTier, ReadsInPlace, OperatedTier, PrefixDeletable):
    """Chunks as files in `root`, within a hard byte budget shared by every process using it."""

    name = "disk"

    def __init__(self, root: str | os.PathLike[str], byte_budget: int | None = None,
                 codec: Codec | str = "raw", eviction: str = DEFAULT_POLICY, fsync: bool = False,
                 tenant_quota: int | None = None, pin_budget: int | None = None) -> None:
        super().__init__(codec)
        self.reads_in_place = self.codec.name == "raw"  # what it writes, it can read in place
        if byte_budget is not None and byte_budget < 0:
            raise ValueError(f"byte budget must be >= 0, got {byte_budget}")
        self.root = Path(root)
        self.fsync = fsync
        self._lock = threading.Lock()
        # Held (before self._lock) while waiting for and holding the directory's flock: a
        # directory another process keeps locked stalls this tier's writes, never its reads.
        self._dir_lock = threading.Lock()
        self._last_usage: tuple[int, int | None] = (0, byte_budget)  # (used, budget) last read
        # this process's view: the files it knows, in eviction order (the budget lives in _dir),
        # and the directory's operator pins as last read from its pin file (pin_budget, None:
        # half the byte budget; expiries on the wall clock, shared with other processes)
        own_pin_budget = pin_budget if pin_budget is not None else default_pin_budget(byte_budget)
        self._index = ByteBudget(None, make_policy(eviction), tenant_quota, own_pin_budget, pin_clock=time.time)
        self._pin_file = PinFile(self.root / PIN_FILE)
        self._pins_saved = self._index.pinned.changes  # the pins' change count the file holds
        self._evictions = 0
        self._read_buffers = ReadBufferPool()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BackendError(f"disk tier cannot create {self.root}: {exc}") from exc
        self._own_budget = byte_budget
        self._dir = DirAccount(self.root)
        self.read_only = not self._dir.writable
        with self._lock:
            if self.read_only:
                self._scan()
                self._sync_pins()
            else:
                with self._dir.locked() as state:
                    state.budget = byte_budget  # the latest opener sets the directory's budget
                    self._recount(state)
                    self._open_pins(own_pin_budget)
                    self._make_room(state, 0)  # a lowered budget trims the directory now
                    self._save_pins(state)

    @classmethod
    def from_spec(cls, spec: TierSpec) -> DiskBackend:
        """Returns the tier a `disk:///path` spec describes (option `fsync`: fsync each file)."""
        path = unquote(urlsplit(spec.url).path)
        return cls(path, byte_budget=spec.budget, codec=spec.codec, eviction=spec.eviction,
                   fsync=bool(spec.options.get("fsync", False)), tenant_quota=spec.tenant_quota,
                   pin_budget=spec.pin_budget)

    def set_hold_check(self, is_held: Callable[[str], bool]) -> None:
        """Makes eviction skip every key for which `is_held` returns True."""
        self._index.is_pinned = is_held

    # -- files and accounting (callers hold self._lock, and the dir lock to change anything) --
    def _path(self, key: str) -> Path:
        return key_path(self.root, key)

    def _scan(self) -> int:
        """Indexes every chunk file (unknown ones oldest first), forgets vanished ones, removes
        dead writers' temp files (unless read-only); returns the bytes in use: chunk files
        plus live writers' reservations."""
        used = 0
        found: list[tuple[str, int]] = []  # (key, size), least recently used first

        def dead_temp(name: str) -> bool:  # a dead writer's temp file: removed, unless read-only
            return name.startswith(TEMP_PREFIX) and live_reservation(name) is None and not self.read_only

        def listed(name: str) -> bool:
            return name.startswith(TEMP_PREFIX) or name == PIN_FILE or name.endswith(SUFFIX)

        for f in entry_scan.scan(self.root, keep=listed, stray=dead_temp, owner=f"disk tier {self.root}"):
            if f.name.startswith(TEMP_PREFIX):
                used += live_reservation(f.name) or 0  # a live writer's reservation (its file grows to it)
                continue
            used += f.size  # a chunk file, or the pin file (the budget counts it too)
            if f.name != PIN_FILE:
                found.append((file_key(f.name), f.size))
        present = {key for key, _ in found}
        for key in [k for k in self._index.sizes if k not in present]:
            self._index.remove(key)
        for key, size in found:
            if key not in self._index:
                self._index.add(key, size)
        return used

    @contextmanager
    def _locked(self, blocking: bool = True) -> Iterator[DirState]:
        """Yields the directory's state under its locks, then this tier's lock; a state file found
        empty or foreign is rebuilt from a recount. `blocking=False`: BlockingIOError if held."""
        if not self._dir_lock.acquire(blocking):
            raise BlockingIOError("the directory's lock is held")
        try:
            with self._dir.locked(blocking) as state, self._lock:
                if state.used < 0:
                    state.budget = self._own_budget
                    self._recount(state)
                self._sync_pins()  # other processes' pins, before anything is evicted
                try:
                    yield state
                except BaseException:
                    self._pin_file.forget()  # pins changed and not saved: re-read next time
                    raise
                self._save_pins(state)
                self._last_usage = (state.used, state.budget)
        finally:
            self._dir_lock.release()

    def _recount(self, state: DirState) -> None:
        state.used = self._scan() + STATE_BYTES

    # -- the directory's pins (callers hold self._lock; the dir lock to save) ---------------
    def _stored(self, key: str) -> bool:
        try:
            return self._path(key).is_file()
        except (ValueError, OSError):  # a key no file can be named for (a foreign pin file's)
            return False

    def _sync_pins(self) -> None:
        """Re-reads the directory's pin file if another process (or a restart) changed it;
        pins of keys whose file is gone are left out."""
        if self._pin_file.refresh(self._index.pinned, self._stored):
            self._pins_saved = self._index.pinned.changes

    def _open_pins(self, budget: int | None) -> None:
        """Loads the directory's pins at open; an existing pin file takes this opener's pin
        budget (pins over a lowered budget are released, most recently set first, with a warning)."""
        pins = self._index.pinned
        self._sync_pins()
        if self._pin_file.size == 0:
            pins.budget = budget  # no pin file: nothing shared yet
            return
        if pins.budget != budget:
            pins.budget = budget
            self._pins_saved = -1  # the file's budget changes
        pinned = pins.bytes
        released = pins.trim()
        if released:
            log.warning("disk tier %s: pin_budget %s is below the %d bytes pinned; released %d pin(s), "
                        "the most recently set first", self.root, budget, pinned, len(released))

    def _pin_file_growth(self) -> int:
        """Returns how many bytes the pin file would grow by if saved now (negative: shrink)."""
        return len(self._index.pinned.to_json()) - self._pin_file.size

    def _save_pins(self, state: DirState) -> None:
        """Writes this process's pins to the directory's pin file if they changed since read
        or saved (the file's bytes counted in the directory's budget); a directory with no pin
        file and no pins stays without one. A write that fails is logged; the pins are re-read."""
        pins = self._index.pinned
        if pins.changes == self._pins_saved:
            return
        if not len(pins) and self._pin_file.size == 0 and not self._pin_file.path.exists():
            self._pins_saved = pins.changes
            return
        grow = self._pin_file_growth()
        if grow > 0:
            self._make_room(state, grow)  # best effort: pin() made room for what it added
        old = self._pin_file.size
        try:
            new = self._pin_file.save(pins)
        except OSError as exc:
            log.error("disk tier %s cannot write its pin file (%s): pins changed here are not kept", self.root, exc)
            self._pin_file.forget()
            return
        state.used += new - old
        self._pins_saved = pins.changes

    def _make_room(self, state: DirState, nbytes: int) -> bool:
        """Evicts files (least recently used first, never pinned ones) until `nbytes` more fit
        in the directory's budget; recounts once if this process's index is not enough.
        Returns whether they fit."""
        budget = state.budget
        if budget is None:
            return True
        if nbytes > budget:
            return False
        for attempt in range(2):
            for victim in self._index.policy.victims():
                if state.used + nbytes <= budget:
                    return True
                if self._index.protected(victim):
                    continue
                state.used -= self._unlink(victim)
                self._evictions += 1
                self._evicted([victim])
            if state.used + nbytes <= budget:
                return True
            if attempt == 0:
                self._recount(state)  # other processes' files, dead writers' reservations
        return False

    def _make_tenant_room(self, state: DirState, key: str, nbytes: int) -> bool:
        """Evicts `key`'s tenant's own files (its least recently used first) until `nbytes` more
        fit in its tenant_quota, counting every process's files of that tenant and live writers'
        reservations for it (listed under the directory's lock); True at once for an unsalted
        key or no quota."""
        tag = key_tenant(key)
        if self._index.tenants.quota is None or tag is None:
            return True
        self._index_prefix(tenant_prefix(tag))
        reserved = sum(live_reservation(name) or 0 for name in tenant_temp_names(self.root, tag))
        victims = self._index.plan(key, nbytes + reserved)
        if victims is None:
            return False
        for victim in victims:
            state.used -= self._unlink(victim)
            self._evictions += 1
            self._evicted([victim])
        return True

    def _index_prefix(self, prefix: str) -> None:
        """Brings this process's index of the files whose key starts with `prefix` up to date
        (other processes' writes and removals)."""
        present = {}
        for key in keys_with_prefix(self.root, prefix):
            size = regular_size(self._path(key))  # None: gone meanwhile, or not a regular file
            if size is not None:
                present[key] = size
        for key in [k for k in self._index.sizes if k.startswith(prefix) and k not in present]:
            self._index.remove(key)
        for key, size in present.items():
            if self._index.sizes.get(key) != size:
                self._index.add(key, size)

    def _unlink(self, key: str) -> int:
        """Removes `key`'s file and index entry; returns the bytes freed (0 if already gone)."""
        path = self._path(key)
        try:
            size = regular_size(path) or 0  # what the account counted: a regular file's bytes
            os.unlink(path)
        except FileNotFoundError:
            size = 0
        except OSError as exc:
            raise BackendError(f"disk tier cannot delete {key}: {exc}") from exc
        self._index.remove(key)
        return size

    def _writable(self) -> None:
        if self.read_only:
            raise BackendError(f"disk tier {self.root} is read-only, writes refused "
                               f"(cannot open {STATE_FILE}: {self._dir.why_read_only})")

    # -- BytesBackend hooks and the contract ----------------------------------------------
    def _exists(self, key: str) -> bool:
        with self._lock:
            if key in self._index:
                return True
        return self._adopt(key)

    def _adopt(self, key: str) -> bool:
        """Indexes a file another process wrote since we scanned; returns whether it exists.
        The stat happens under the lock: our own renames and unlinks happen under it too."""
        with self._lock:
            try:
                size = regular_size(self._path(key))
            except OSError as exc:
                raise BackendError(f"disk tier cannot stat {key}: {exc}") from exc
            if size is None:  # none, or not a regular file: never read as a chunk
                return False
            if key not in self._index:
                self._index.add(key, size)  # counted in the directory's state by its writer
        return True

    def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        """Returns, per key, whether its file exists (any process's: another's is indexed here)."""
        return [self._exists(k) for k in keys]

    @contextmanager
    def _opened(self, key: str) -> Iterator[int | None]:
        """Yields a descriptor of `key`'s file opened for reading, or None if there is none
        (then forgotten); once the body returned, marks the file recently used."""
        path = self._path(key)
        try:
            fd = open_regular(path)
        except (FileNotFoundError, NotRegularFile):  # a link, FIFO or directory is a miss, never read
            with self._lock:  # forget it only if still absent: a writer may have just renamed it in
                if self._absent(path):
                    self._index.remove(key)
            yield None
            return
        except OSError as exc:
            raise BackendError(f"disk tier cannot read {key}: {exc}") from exc
        try:
            yield fd
        except OSError as exc:
            raise BackendError(f"disk tier cannot read {key}: {exc}") from exc
        finally:
            os.close(fd)
        try:
            os.utime(path)  # the LRU order survives restarts through mtime
        except OSError:
            pass  # read-only, another user's file, or replaced since: the value read is whole
        with self._lock:
            self._index.touch(key)

    @staticmethod
    def _absent(path: Path) -> bool:
        """Returns whether no regular file is at `path` (False if that cannot be told)."""
        try:
            return regular_size(path) is None
        except OSError:
            return False

    def _batched_get_bytes(self, keys: Sequence[str]) -> list[ReadValue | None]:
        return [self._read(k) for k in keys]

    def _read(self, key: str) -> ReadValue | None:
        with self._opened(key) as fd:
            return None if fd is None else read_value(fd, key, self._read_buffers)

    def batched_read_into(self, keys: Sequence[str], dests: Sequence[Destination]
                          ) -> list[torch.Tensor | Destination | None]:
        """Reads each raw value of `dest.dtype` and `dest.shape` straight into its destination
        (`file_io.read_in_place`: no buffer between the page cache and `dest`); any other
        value comes back decoded, as `batched_get` returns it. Hits, misses and corrupt values
        are counted as `batched_get` counts them."""
        if len(keys) != len(dests):
            raise ValueError(f"one destination per key: {len(keys)} keys, {len(dests)} destinations")
        out: list[torch.Tensor | Destination | None] = []
        for key, dest in zip(keys, dests, strict=True):
            try:
                with self._opened(key) as fd:
                    done = fd is not None and read_in_place(fd, key, dest)
                    other = fd is not None and not done
            except serde.SerdeError:
                self._refuse(key)
                out.append(None)
                continue
            if other:  # not raw dest.dtype of dest.shape: read and decoded as batched_get does
                out.append(self.batched_get([key])[0])
            else:
                self._count(hit=done)
                out.append(dest if done else None)
        return out

    def _encode(self, key: str, kv: torch.Tensor) -> serde.SplitValue:
        """Returns header + payload unjoined: the file gets them in two writes, no copy."""
        return serde.encode_split(key, kv, self.codec)

    def _batched_put_bytes(self, items: Sequence[tuple[str, StoredValue]]) -> list[bool]:
        return [self._write(key, value) for key, value in items]

    def _write(self, key: str, value: StoredValue) -> bool:
        self._writable()
        path = self._path(key)
        parts = file_parts(value)
        nbytes = sum(memoryview(part).nbytes for part in parts)
        tmp = temp_path(self.root, nbytes, key_tenant(key))  # a salted key's temp file names its tenant
        try:
            with self._locked() as state:
                if not (self._make_tenant_room(state, key, nbytes) and self._make_room(state, nbytes)):
                    with self._stats_lock:
                        self._rejected += 1
                    return False
                # reserved, and the temp file exists before the lock is released, so a recount
                # by any process sees the reservation in its name
                fd = create_temp(tmp)
                state.used += nbytes
        except OSError as exc:
            raise BackendError(f"disk tier cannot write {key}: {exc}") from exc
        try:
            write_parts(fd, parts, self.fsync)
            with self._locked() as state:
                old = regular_size(path) or 0  # a link or FIFO replaced was never counted
                install(tmp, path)
                state.used -= old  # the replaced file; the reservation is now this file
                self._index.add(key, nbytes)
            return True
        except OSError as exc:
            with self._locked() as state:
                discard(tmp)
                state.used -= nbytes
            raise BackendError(f"disk tier cannot write {key}: {exc}") from exc

    def delete(self, key: str) -> bool:
        """Removes `key`'s file; returns whether there was one. BackendError if read-only."""
        self._writable()
        with self._locked() as state:
            freed = self._unlink(key)
            state.used -= freed
            return freed > 0

    def delete_prefix(self, prefix: str) -> int:
        """Removes every file (any process's) whose key starts with `prefix`; returns how many."""
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix")
        return sum(self.delete(k) for k in keys_with_prefix(self.root, prefix))

    def clear(self) -> None:
        """Removes the files in this process's index (those found when it opened the directory,
        and those it has written or found since)."""
        self._writable()
        with self._locked() as state:
            for key in list(self._index.sizes):
                state.used -= self._unlink(key)

    # -- operating the cache (the directory's pins: shared by every process using it, kept
    # across restarts in its pin file) ------------------------------------------------------
    def describe(self, keys: Sequence[str]) -> list[EntryInfo | None]:
        """Per key its file's size, seconds since its last use (mtime: reads touch it) and its
        pin (any process's); its age is unknown (a file's mtime is its last use, not its creation)."""
        out: list[EntryInfo | None] = []
        with self._lock:
            self._sync_pins()  # once: the pin file's state as of this call
        for key in keys:
            if not self._adopt(key):  # no file, or not a regular one
                out.append(None)
                continue
            try:
                st = os.stat(self._path(key))
            except FileNotFoundError:  # removed meanwhile
                out.append(None)
                continue
            except OSError as exc:
                raise BackendError(f"disk tier cannot stat {key}: {exc}") from exc
            with self._lock:
                pin = self._index.pinned.info(key)
            out.append(EntryInfo.held(st.st_size, None, max(0.0, time.time() - st.st_mtime), pin))
        return out

    def usage(self) -> dict[UsageGroup, tuple[int, int]]:
        """Counts the files this process knows (found at open, written or found since)."""
        with self._lock:
            return self._index.usage_by(usage_group)

    def pin(self, keys: Sequence[str], ttl_s: float | None = None) -> int:
        """Pins stored `keys` in the directory's pin file, all or none, within its pin budget
        counting every process's pins; returns the bytes newly pinned. PinError (nothing
        pinned) as `StorageBackend.pin`, or when the pin file finds no room; BackendError if read-only."""
        self._writable()
        present = [self._exists(k) for k in keys]  # another process's file is indexed here
        with self._locked() as state:
            held = {k: self._index.sizes[k] for k, p in zip(keys, present) if p and k in self._index}
            added = self._index.pinned.pin_held(keys, held, ttl_s, self.name)
            grow = self._pin_file_growth()
            if grow <= 0 or self._make_room(state, grow):
                return added
            self._pin_file.forget()
            self._sync_pins()  # back to the pins before this call
        raise PinError(f"tier {self.name}: no room in the directory's budget for its pin file "
                       f"({grow} more bytes; only pinned chunks are left); nothing was pinned")

    def unpin(self, keys: Sequence[str]) -> int:
        """Releases the pins of `keys` (whichever process set them); returns how many were pinned.
        BackendError if read-only."""
        self._writable()
        with self._locked():
            return self._index.pinned.unpin(keys)

    def set_budget(self, byte_budget: int | None = None, pin_budget: int | None = None,
                   tenant_quota: int | None = None) -> None:
        """Changes the directory's shared budget, this process's pin budget and quota (None: unchanged),
        evicting LRU files of any process (never pinned here) before it returns; as `MemoryBackend`'s."""
        self._writable()
        with self._locked() as state:
            self._recount(state)  # every process's files and live writers' reservations
            limits = self._index.plan_limits(byte_budget, pin_budget, tenant_quota,
                                             account=(state.used, state.budget), tier=self.name)
            pin_budget_before = self._index.pinned.budget
            self._index.apply_limits(limits, own_budget=False)
            if self._index.pinned.budget != pin_budget_before:
                self._pins_saved = -1  # the pin file carries the directory's pin budget: saved below
            state.budget = self._own_budget = limits.budget
            for victim in limits.victims:
                state.used -= self._unlink(victim)
                self._evictions += 1
            self._evicted(limits.victims)

    def delete_idle(self, older_than_s: float) -> int:
        """Removes the chunk files this process knows whose last use (mtime) is `older_than_s`
        seconds ago or more, never a pinned one nor the tier's own bookkeeping (the key
        families' index); one stat per file known."""
        self._writable()
        cutoff = time.time() - older_than_s
        removed = 0
        with self._locked() as state:
            for key in list(self._index.sizes):
                try:
                    idle = os.stat(self._path(key)).st_mtime <= cutoff
                except FileNotFoundError:
                    self._index.remove(key)
                    continue
                if idle and is_chunk_key(key) and not self._index.protected(key):
                    freed = self._unlink(key)
                    state.used -= freed
                    removed += freed > 0
        return removed

    def stats(self) -> BackendStats:
        s = super().stats()
        with self._lock:
            self._sync_pins()
            s.can_pin, s.pinned_entries = True, len(self._index.pinned)
            s.pinned_bytes, s.pin_budget = self._index.pinned.bytes, self._index.pinned.budget
        return s

    def _usage(self) -> tuple[int, int, int | None, int]:
        """Returns (files this process knows, the directory's bytes in use, its budget, evictions)."""
        if self.read_only:
            with self._lock:
                return len(self._index), self._index.used, None, self._evictions
        try:
            with self._locked(blocking=False) as state:
                return len(self._index), state.used, state.budget, self._evictions
        except BlockingIOError:  # a write (or another process) holds the directory: the last figures
            used, budget = self._last_usage
            with self._lock:
                return len(self._index), used, budget, self._evictions

    def close(self) -> None:
        """Closes the directory's state file; the files stay, for the next opener."""
        with self._lock:
            self._dir.close()
