"""KV cache events: which chunks each tier now holds or lost, for an engine that publishes
them (vLLM's `BlockStored` / `BlockRemoved`, the tier as medium; docs/vllm.md).

Two halves, like the connector: the worker's `TierChangeLog` hears its storage manager (keys
stored per tier, evicted or deleted) and is drained every step into the report that crosses
to the scheduler process; the scheduler's `ChunkEventBuilder` knows each planned chunk's
tokens and chain hashes, and turns that report into `ChunkEvent`s. A chunk is announced once
per tier when its first value lands there, and withdrawn once per tier when any of its values
leaves; a tier never announced is never withdrawn. Chunks stored before this process
started, or removed by a tier that cannot see its evictions (the cache server, Redis's own
maxmemory policy), are not reported.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from connector.metadata import SaveSpec
from kvkeys.keyspace import Keyspace

TierKey = tuple[str, str]
"""(tier name, stored key)."""


class TierChangeLog:
    """What the storage manager's tiers stored and removed since the last `drain()`, oldest
    first; thread-safe. Holds at most `limit` entries: past that the oldest are dropped and
    counted in `dropped` (a scheduler that stopped draining must not grow it)."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self.limit = limit
        self.dropped = 0
        self._lock = threading.Lock()
        self._stored: list[TierKey] = []
        self._removed: list[TierKey] = []

    def _add(self, into: list[TierKey], tier: str, keys: list[str]) -> None:
        with self._lock:
            into.extend((tier, k) for k in keys)
            over = len(self._stored) + len(self._removed) - self.limit
            if over > 0:
                cut = min(over, len(into))
                del into[:cut]
                self.dropped += cut

    def stored(self, tier: str, keys: list[str]) -> None:
        self._add(self._stored, tier, keys)

    def removed(self, tier: str, keys: list[str]) -> None:
        self._add(self._removed, tier, keys)

    def drain(self) -> tuple[list[TierKey], list[TierKey]]:
        """Returns (stored, removed) since the last call, and forgets them."""
        with self._lock:
            out = self._stored, self._removed
            self._stored, self._removed = [], []
            return out


@dataclass(frozen=True)
class ChunkEvent:
    """A chunk `stored` on, or `removed` from, one tier (`medium`). `chain` is the chunk's
    chained hash (kvkeys/keyspace.py), `parent` the previous chunk's (None: the first)."""

    kind: str  # "stored" | "removed"
    medium: str
    chain: bytes
    parent: bytes | None = None
    token_ids: tuple[int, ...] = ()  # the chunk's tokens ("stored" only; a partial last chunk is shorter)


@dataclass
class _Chunk:
    chain: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    on: set[str] = field(default_factory=set)  # tiers it was announced on


class ChunkEventBuilder:
    """Scheduler side: remembers the chunks it planned to save (the newest `capacity` stored
    values' worth) and turns the worker's tier reports into `ChunkEvent`s."""

    def __init__(self, keyspace: Keyspace, capacity: int = 1 << 16) -> None:
        self.keyspace = keyspace
        self.capacity = capacity
        self._chunks: OrderedDict[str, _Chunk] = OrderedDict()  # stored key -> its chunk

    def planned(self, save: SaveSpec, tokens: Sequence[int], cache_salt: str | None = None) -> None:
        """Records the chunks of `save` (`tokens`: the request's tokens, at least through the
        last span; `cache_salt`: the request's) so their reports can name tokens and parents."""
        if not save.spans:
            return
        ks = self.keyspace.for_salt(cache_salt)
        first = save.spans[0]
        parent = ks.spans(tokens[:first.start], unfull=False)[-1].chain if first.start else None
        for sp in save.spans:
            chunk = _Chunk(sp.chain, parent, tuple(tokens[sp.start:sp.end]))
            for key in ks.stored_keys([sp]):
                self._chunks[key] = chunk
                self._chunks.move_to_end(key)
            if sp.num_tokens == ks.chunk_size:
                parent = sp.chain
        while len(self._chunks) > self.capacity:
            self._chunks.popitem(last=False)

    def events(self, stored: list[TierKey], removed: list[TierKey]) -> list[ChunkEvent]:
        """Returns the events of one worker report: a chunk's first value on a tier announces
        it there, any value leaving withdraws it; keys it never planned are skipped."""
        out: list[ChunkEvent] = []
        for tier, key in stored:
            chunk = self._chunks.get(key)
            if chunk is not None and tier not in chunk.on:
                chunk.on.add(tier)
                out.append(ChunkEvent("stored", tier, chunk.chain, chunk.parent, chunk.token_ids))
        for tier, key in removed:
            chunk = self._chunks.get(key)
            if chunk is not None and tier in chunk.on:
                chunk.on.discard(tier)
                out.append(ChunkEvent("removed", tier, chunk.chain))
        return out
