"""What the tiers hold, by existence only: the one place that asks "is this chunk held?"
for the planner's lookup, the saver's skip of stored chunks and `/kv/lookup`.

A chunk is held when some tier holds (or a pending store carries) every stored value of it
(connector/keyspace.py). One batched existence query per tier per call; no value is read.
`Presence` lives with the store (the worker side, whose store queue knows what is pending);
a planner in the same process asks it directly, one in another process (vLLM's scheduler)
asks it through connector/lookup_channel.py's `RemotePresence`. Both answer the planner's one
question, `ChunkPresence.chunks_held`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from connector.keyspace import Keyspace, Span
from kvstore.storage_manager import StorageManager


class ChunkPresence(ABC):
    """Answers "which of these chunks are held?" from existence alone."""

    @abstractmethod
    def held(self, keys: Sequence[str]) -> list[bool]:
        """Returns per stored key whether it is held (stored, or carried by a pending store)."""

    @abstractmethod
    def tier_prefix_hits(self, keys: Sequence[str]) -> dict[str, int]:
        """Returns, per tier name (fastest first), how many of `keys` from the start that tier
        holds by itself (pending stores not counted: they are in no tier yet)."""

    def tier_prefix_chunks(self, keyspace: Keyspace, spans: Sequence[Span]) -> dict[str, int]:
        """Returns, per tier name (fastest first), how many leading spans that tier holds whole."""
        hits = self.tier_prefix_hits(keyspace.stored_keys(spans))
        return {name: n // keyspace.values_per_chunk for name, n in hits.items()}

    def chunks_held(self, keyspace: Keyspace, spans: Sequence[Span], last_layer_only: bool = False) -> list[bool]:
        """Returns per span whether its chunk is held: every stored value of it, or with
        `last_layer_only` just its last (a cheap probe over many candidates)."""
        if last_layer_only:
            return self.held(keyspace.last_layer_keys(spans))
        return keyspace.chunks_held(self.held(keyspace.stored_keys(spans)))


class Presence(ChunkPresence):
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
