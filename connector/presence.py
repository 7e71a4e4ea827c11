"""What the tiers hold, by existence only: the one place that asks "is this chunk held?"
for the planner's lookup, the saver's skip of stored chunks and `/kv/lookup`.

A chunk is held when some tier holds (or a pending store carries) every stored value of it
(connector/keyspace.py). One batched existence query per tier per call; no value is read.
`Presence` lives with the store (the worker side, whose store queue knows what is pending);
a planner in the same process asks it directly, one in another process (vLLM's scheduler)
asks it through connector/lookup_channel.py's `RemotePresence`, one per tensor-parallel rank
under a `RankedPresence`. All answer the planner's one question, `ChunkPresence.chunks_held`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from connector.keyspace import Keyspace, Span
from kvstore.storage_manager import StorageManager


class ChunkPresence(ABC):
    """Answers "which of these chunks are held?" from existence alone."""

    @abstractmethod
    def chunks_held(self, keyspace: Keyspace, spans: Sequence[Span], probe_only: bool = False) -> list[bool]:
        """Returns per span whether its chunk is held: every stored value of it, or with
        `probe_only` just its probe key (`Keyspace.probe_keys`: cheap over many candidates)."""

    @abstractmethod
    def tier_prefix_chunks(self, keyspace: Keyspace, spans: Sequence[Span]) -> dict[str, int]:
        """Returns, per tier name (fastest first), how many leading spans that tier holds whole
        by itself (pending stores not counted: they are in no tier yet); {} when unknown."""


class KeyPresence(ChunkPresence):
    """A `ChunkPresence` that answers per stored key, over one process's tiers."""

    @abstractmethod
    def held(self, keys: Sequence[str]) -> list[bool]:
        """Returns per stored key whether it is held (stored, or carried by a pending store)."""

    @abstractmethod
    def tier_prefix_hits(self, keys: Sequence[str]) -> dict[str, int]:
        """Returns, per tier name (fastest first), how many of `keys` from the start that tier
        holds by itself (pending stores not counted: they are in no tier yet)."""

    def tier_prefix_chunks(self, keyspace: Keyspace, spans: Sequence[Span]) -> dict[str, int]:
        hits = self.tier_prefix_hits(keyspace.stored_keys(spans))
        return {name: n // keyspace.values_per_chunk for name, n in hits.items()}

    def chunks_held(self, keyspace: Keyspace, spans: Sequence[Span], probe_only: bool = False) -> list[bool]:
        if probe_only:
            return self.held(keyspace.probe_keys(spans))
        return keyspace.chunks_held(self.held(keyspace.stored_keys(spans)))


class Presence(KeyPresence):
    """Existence answers over a storage manager and the keys a store queue still carries."""

    def __init__(self, storage: StorageManager, pending: Callable[[str], bool] | None = None) -> None:
        self.storage = storage
        self._pending = pending

    def held(self, keys: Sequence[str]) -> list[bool]:
        """Returns per stored key whether a pending store carries it or some tier holds it
        (one batched query per tier for the keys not pending)."""
        pending = self._pending
        held = [pending(k) for k in keys] if pending is not None else [False] * len(keys)
        rest = [k for k, h in zip(keys, held) if not h]
        if rest:
            found = iter(self.storage.batched_contains(rest))
            held = [h or next(found) for h in held]
        return held

    def tier_prefix_hits(self, keys: Sequence[str]) -> dict[str, int]:
        return self.storage.tier_prefix_hits(keys)


class RankedPresence(ChunkPresence):
    """The presence of chunks split over tensor-parallel ranks: rank r holds the KV heads
    `heads[r]` of every chunk, and answers through `ranks[r]`. A chunk is held when every rank
    holds its heads of it (so every rank can load it); a tier's run is the shortest rank's."""

    def __init__(self, ranks: Sequence[ChunkPresence], heads: Sequence[tuple[int, int]]) -> None:
        if len(ranks) != len(heads) or not ranks:
            raise ValueError(f"one head range per rank: {len(ranks)} ranks, {len(heads)} ranges")
        self.ranks = list(ranks)
        self.heads = list(heads)

    def chunks_held(self, keyspace: Keyspace, spans: Sequence[Span], probe_only: bool = False) -> list[bool]:
        held = [True] * len(spans)
        for rank, heads in zip(self.ranks, self.heads):
            if any(held):
                answer = rank.chunks_held(self._covering(keyspace, heads), spans, probe_only)
                held = [h and r for h, r in zip(held, answer)]
        return held

    def tier_prefix_chunks(self, keyspace: Keyspace, spans: Sequence[Span]) -> dict[str, int]:
        runs = [rank.tier_prefix_chunks(self._covering(keyspace, heads), spans)
                for rank, heads in zip(self.ranks, self.heads)]
        if not all(runs):
            return {}  # a rank did not answer: nothing is known
        return {name: min(r.get(name, 0) for r in runs) for name in runs[0]}

    @staticmethod
    def _covering(keyspace: Keyspace, heads: tuple[int, int]) -> Keyspace:
        """Returns `keyspace` narrowed to a rank's heads (unsplit keyspaces: every value has all)."""
        return keyspace if keyspace.heads is None else keyspace.for_heads(*heads)


def held_tokens(spans: Sequence[Span], chunks: dict[str, int], num_tokens: int) -> dict[str, int]:
    """Returns per tier the leading tokens of a `num_tokens`-token sequence that tier holds,
    given per tier how many of its leading `spans` it holds; never the last token (always
    computed)."""
    limit = num_tokens - 1
    return {name: min(spans[n - 1].end, limit) if n else 0 for name, n in chunks.items()}
