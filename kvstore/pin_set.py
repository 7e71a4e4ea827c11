"""Operator pins of one tier: chunks an operator keeps from eviction (`POST /kv/pin`,
`kvtier cache pin`), within the tier's own pin budget, optionally until an expiry.

They are not the storage manager's load holds (kvstore/load_holds.py), which are counts held
for the length of one load and shared by every tier: an operator pin belongs to one tier, is
set and released by an operator, is bounded in bytes and may expire. A tier's eviction skips a
key held or pinned (`ByteBudget.protected`).

A pin is per stored key and idempotent: pinning a pinned key sets its expiry anew, unpinning
it once releases it (two pinned prompts sharing a prefix share its chunks' pins). A key
removed from its tier (deleted, cleared, its tenant forgotten) loses its pin with it: pins
keep chunks from eviction, never from an explicit removal.

The cpu and device tiers keep their pins in the process's memory (a restart forgets them). The
tiers that persist (the disk tier, the cache server's spill) keep a copy of theirs on disk
(kvstore/pin_file.py: `to_json`/`load_json`, expiries on the wall clock): the disk tier
re-reads it whenever another process changed it, the cache server at startup.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass


class PinError(ValueError):
    """A pin that was refused (over the pin budget, a chunk not held, a tier that cannot
    pin); nothing was pinned."""


def default_pin_budget(byte_budget: int | None) -> int | None:
    """Returns a tier's pin budget when its spec sets none: half its byte budget (None: none)."""
    return None if byte_budget is None else byte_budget // 2


@dataclass(frozen=True)
class PinInfo:
    """One key's pin: its bytes as pinned and the seconds left before it expires (None: never)."""

    nbytes: int
    expires_in_s: float | None


class PinSet:
    """The pinned keys of one tier, their bytes and expiries; `budget` bounds the bytes pinned
    at once (None: no bound). Not thread-safe: the owning tier calls it under its lock.

    Exact: `bytes` is the sum of the pinned keys' bytes, never above `budget`, and back to 0
    once every pin was released, expired or its key removed.
    """

    def __init__(self, budget: int | None, clock: Callable[[], float] = time.monotonic) -> None:
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ValueError(f"pin budget must be a byte count >= 0, got {budget!r}")
        self.budget = budget
        self.bytes = 0
        self._clock = clock
        self._pins: dict[str, tuple[int, float | None]] = {}  # key -> (bytes, deadline or None)
        self.changes = 0  # counts every change to the pins (a persisted set is saved when it moved)

    def __len__(self) -> int:
        self.expire()
        return len(self._pins)

    def holds(self, key: str) -> bool:
        """Returns whether `key` is pinned now (an expired pin is released here)."""
        entry = self._pins.get(key)
        if entry is None:
            return False
        if entry[1] is not None and self._clock() >= entry[1]:
            self.release(key)
            return False
        return True

    def keys(self) -> list[str]:
        """Returns the pinned keys (expired pins released first)."""
        self.expire()
        return list(self._pins)

    def info(self, key: str) -> PinInfo | None:
        """Returns `key`'s pin, or None when it is not pinned."""
        if not self.holds(key):
            return None
        nbytes, deadline = self._pins[key]
        return PinInfo(nbytes, None if deadline is None else max(0.0, deadline - self._clock()))

    def pin(self, items: Sequence[tuple[str, int]], ttl_s: float | None = None, tier: str = "tier") -> int:
        """Pins every `(key, stored bytes)`, all or none: PinError (nothing changed) when the
        pins would pass the budget. A re-pinned key gets the new expiry. Returns the bytes
        newly pinned."""
        if ttl_s is not None and not ttl_s > 0:
            raise PinError(f"ttl_s must be > 0 seconds, got {ttl_s!r}")
        self.expire()
        sizes = dict(items)
        delta = sum(n - self._pins.get(k, (0, None))[0] for k, n in sizes.items())
        if self.budget is not None and self.bytes + delta > self.budget:
            raise PinError(f"tier {tier}: pinning {len(sizes)} chunk value(s) needs {delta} more bytes, "
                           f"{self.bytes} of its pin budget {self.budget} are pinned; nothing was pinned "
                           "(unpin something, or raise the tier's pin_budget)")
        deadline = None if ttl_s is None else self._clock() + ttl_s
        for key, nbytes in sizes.items():
            self._pins[key] = (nbytes, deadline)
        self.bytes += delta
        self.changes += 1
        return delta

    def pin_held(self, keys: Sequence[str], held: Mapping[str, int], ttl_s: float | None = None,
                 tier: str = "tier") -> int:
        """`pin` of `keys` at their sizes in `held` (the tier's stored values); PinError
        (nothing pinned) when any key is not held. Returns the bytes newly pinned."""
        missing = sum(k not in held for k in keys)
        if missing:
            raise PinError(f"tier {tier}: {missing} of the {len(keys)} chunk value(s) to pin are not "
                           "stored here (evicted meanwhile?); nothing was pinned")
        return self.pin([(k, held[k]) for k in keys], ttl_s, tier)

    def release(self, key: str) -> bool:
        """Releases `key`'s pin (unpinned, expired, or its key removed); whether it had one."""
        entry = self._pins.pop(key, None)
        if entry is None:
            return False
        self.bytes -= entry[0]
        self.changes += 1
        return True

    def unpin(self, keys: Iterable[str]) -> int:
        """Releases the pins of `keys`; returns how many were pinned (expired ones do not count)."""
        self.expire()
        return sum(self.release(k) for k in set(keys))

    def resize(self, key: str, nbytes: int) -> None:
        """Records that pinned `key` was stored again with `nbytes`; releases its pin when the
        new size would pass the budget (the budget is never exceeded)."""
        entry = self._pins.get(key)
        if entry is None or entry[0] == nbytes:
            return
        if self.budget is not None and self.bytes - entry[0] + nbytes > self.budget:
            self.release(key)
            return
        self._pins[key] = (nbytes, entry[1])
        self.bytes += nbytes - entry[0]
        self.changes += 1

    def expire(self) -> int:
        """Releases every expired pin; returns how many."""
        now = self._clock()
        done = [k for k, (_, deadline) in self._pins.items() if deadline is not None and now >= deadline]
        for key in done:
            self.release(key)
        return len(done)

    def clear(self) -> None:
        """Releases every pin (a change only if there were any)."""
        if self._pins:
            self._pins.clear()
            self.bytes = 0
            self.changes += 1

    def trim(self) -> list[str]:
        """Releases pins, the most recently added first, until `bytes` is within `budget` (one
        lowered since they were set); returns the keys released."""
        released: list[str] = []
        for key in reversed(list(self._pins)):
            if self.budget is None or self.bytes <= self.budget:
                break
            self.release(key)
            released.append(key)
        return released

    def to_json(self) -> bytes:
        """Returns the pins and budget as JSON (`kind`, `version`, `budget`, `pins`: key ->
        [bytes, expiry on this set's clock or null]), expired pins left out."""
        self.expire()
        pins = {k: [n, d] for k, (n, d) in self._pins.items()}
        return json.dumps({"kind": PIN_FILE_KIND, "version": PIN_FILE_VERSION, "budget": self.budget,
                           "pins": pins}, separators=(",", ":")).encode()

    def load_json(self, data: bytes, exists: Callable[[str], bool] | None = None) -> None:
        """Replaces the pins and budget with those `data` (`to_json`'s) holds, leaving out
        expired pins and (with `exists`) pins of keys no longer stored. ValueError, nothing
        changed, when `data` is not a pin set of this version or claims more than its budget."""
        budget, pins = _parse(data)
        now = self._clock()
        kept = {k: v for k, v in pins.items()
                if (v[1] is None or now < v[1]) and (exists is None or exists(k))}
        self.budget = budget
        self._pins = kept
        self.bytes = sum(n for n, _ in kept.values())
        self.changes += 1


PIN_FILE_KIND = "kvtier-pins"
"""The `kind` of a persisted pin set (`PinSet.to_json`); any other is foreign."""
PIN_FILE_VERSION = 1


def _parse(data: bytes) -> tuple[int | None, dict[str, tuple[int, float | None]]]:
    """Returns (budget, pins) of a persisted pin set; ValueError naming what is wrong."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("kind") != PIN_FILE_KIND:
        raise ValueError(f"not a kvtier pin file (kind {PIN_FILE_KIND!r} expected)")
    if doc.get("version") != PIN_FILE_VERSION:
        raise ValueError(f"pin file version {doc.get('version')!r}, this kvtier reads {PIN_FILE_VERSION}")
    budget, raw = doc.get("budget"), doc.get("pins")
    if budget is not None and not _count(budget):
        raise ValueError(f"budget {budget!r} is not a byte count")
    if not isinstance(raw, dict):
        raise ValueError("pins is not an object")
    pins: dict[str, tuple[int, float | None]] = {}
    for key, entry in raw.items():
        if not (isinstance(entry, list) and len(entry) == 2 and _count(entry[0])
                and (entry[1] is None or (isinstance(entry[1], (int, float)) and not isinstance(entry[1], bool)
                                          and math.isfinite(entry[1])))):
            raise ValueError(f"pin of {key[:40]!r} is not [bytes, expiry or null]")
        pins[key] = (entry[0], None if entry[1] is None else float(entry[1]))
    total = sum(n for n, _ in pins.values())
    if budget is not None and total > budget:
        raise ValueError(f"{total} bytes pinned, more than its budget {budget}")
    return budget, pins


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
