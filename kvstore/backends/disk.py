"""The `disk` tier: one file per chunk under a directory (`disk:///path`).

Writes go to a temporary file, optionally fsync'd, then atomically renamed into place, so a
reader never sees a partial value and a crash leaves only a stray temp file (removed on
start). On start the index is rebuilt by scanning the directory: sizes from stat, LRU order
from mtime (reads touch mtime, so the order survives restarts). A full or read-only disk
raises BackendError.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

import torch

from kvstore import serde
from kvstore.backend import BackendError, BytesBackend
from kvstore.budget import ByteBudget
from kvstore.codecs import Buffer, Codec
from kvstore.config import TierSpec
from kvstore.eviction import make_policy

_SUFFIX = ".kvc"
_TMP_PREFIX = ".tmp-"


class DiskBackend(BytesBackend):
    """Chunks as files in `root`, within a hard byte budget (file sizes)."""

    name = "disk"

    def __init__(self, root: str | os.PathLike[str], byte_budget: int | None = None,
                 codec: Codec | str = "raw", eviction: str = "lru", fsync: bool = False) -> None:
        super().__init__(codec)
        self.root = Path(root)
        self.fsync = fsync
        self._lock = threading.Lock()
        self._budget = ByteBudget(byte_budget, make_policy(eviction))
        self._evictions = 0
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BackendError(f"disk tier cannot create {self.root}: {exc}") from exc
        self._recover()

    @classmethod
    def from_spec(cls, spec: TierSpec) -> DiskBackend:
        path = unquote(urlsplit(spec.url).path)
        return cls(path, byte_budget=spec.budget, codec=spec.codec, eviction=spec.eviction,
                   fsync=bool(spec.options.get("fsync", False)))

    def set_pin_check(self, is_pinned: Callable[[str], bool]) -> None:
        self._budget.is_pinned = is_pinned

    # -- files ---------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        name = quote(key, safe="") + _SUFFIX
        if len(name) > 255:
            raise ValueError(f"key too long for a file name ({len(name)} > 255 bytes): {key[:40]}...")
        return self.root / name

    def _recover(self) -> None:
        """Rebuilds the index from the directory: stray temp files removed, LRU by mtime."""
        found: list[tuple[float, str, int]] = []
        with os.scandir(self.root) as it:
            for entry in it:
                if entry.name.startswith(_TMP_PREFIX):
                    try:
                        os.unlink(entry.path)
                    except OSError:
                        pass
                elif entry.name.endswith(_SUFFIX) and entry.is_file():
                    st = entry.stat()
                    found.append((st.st_mtime, unquote(entry.name[: -len(_SUFFIX)]), st.st_size))
        found.sort()
        with self._lock:
            for _, key, size in found:
                self._budget.add(key, size)
            # an over-budget directory (budget lowered since last run) is trimmed oldest first
            if self._budget.budget is not None and self._budget.used > self._budget.budget:
                for key in list(self._budget.policy.victims()):
                    if self._budget.used <= self._budget.budget:
                        break
                    self._unlink(key)

    def _unlink(self, key: str) -> None:
        """Removes `key`'s file and index entry (under the lock)."""
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise BackendError(f"disk tier cannot delete {key}: {exc}") from exc
        self._budget.remove(key)

    # -- BytesBackend hooks --------------------------------------------------------------
    def _contains(self, key: str) -> bool:
        with self._lock:
            if key in self._budget:
                return True
        return self._adopt(key)

    def _adopt(self, key: str) -> bool:
        """Indexes a file another process wrote since we scanned; returns whether it exists.
        The stat happens under the lock: our own renames and unlinks happen under it too."""
        with self._lock:
            try:
                size = os.stat(self._path(key)).st_size
            except FileNotFoundError:
                return False
            except OSError as exc:
                raise BackendError(f"disk tier cannot stat {key}: {exc}") from exc
            if key not in self._budget and self._budget.plan(key, size) == []:
                self._budget.add(key, size)
        return True

    def _batched_contains(self, keys: Sequence[str]) -> list[bool]:
        return [self._contains(k) for k in keys]

    def _get_bytes(self, key: str) -> Buffer | None:
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                buf = bytearray(size)
                n = f.readinto(buf)
        except FileNotFoundError:
            with self._lock:  # forget it only if still absent: a writer may have just renamed it in
                if not path.exists():
                    self._budget.remove(key)
            return None
        except OSError as exc:
            raise BackendError(f"disk tier cannot read {key}: {exc}") from exc
        try:
            os.utime(path)  # the LRU order survives restarts through mtime
        except FileNotFoundError:
            pass  # evicted or replaced since we opened it; what we read is still a whole value
        except OSError as exc:
            raise BackendError(f"disk tier cannot touch {key}: {exc}") from exc
        with self._lock:
            if key in self._budget:
                self._budget.touch(key)
        return buf if n == size else memoryview(buf)[:n]

    def encode(self, key: str, kv: torch.Tensor) -> serde.SplitValue:
        """Returns header + payload unjoined: the file gets them in two writes, no copy."""
        return serde.encode_split(key, kv, self.codec)

    def _put_bytes(self, key: str, value: Buffer | serde.SplitValue) -> None:
        path = self._path(key)
        nbytes = len(value)
        if self._budget.budget is not None and nbytes > self._budget.budget:
            self._rejected_one()  # can never fit: do not write it just to delete it
            return
        parts = [value.header, value.payload] if isinstance(value, serde.SplitValue) else [value]
        tmp = self.root / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb", buffering=0) as f:
                for part in parts:
                    view = memoryview(part).cast("B")
                    while view:  # raw writes may be short
                        view = view[f.write(view):]
                if self.fsync:
                    os.fsync(f.fileno())
            with self._lock:
                victims = self._budget.plan(key, nbytes)
                if victims is None:
                    os.unlink(tmp)
                    self._rejected_one()
                    return
                for victim in victims:
                    self._unlink(victim)
                    self._evictions += 1
                os.replace(tmp, path)
                self._budget.add(key, nbytes)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise BackendError(f"disk tier cannot write {key}: {exc}") from exc

    def _rejected_one(self) -> None:
        with self._stats_lock:
            self._rejected += 1

    def _delete(self, key: str) -> bool:
        with self._lock:
            present = key in self._budget or self._path(key).exists()
            self._unlink(key)
            return present

    def _clear(self) -> None:
        with self._lock:
            for key in list(self._budget.sizes):
                self._unlink(key)

    def _usage(self) -> tuple[int, int, int | None, int]:
        with self._lock:
            return len(self._budget), self._budget.used, self._budget.budget, self._evictions
