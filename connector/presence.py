"""What the tiers hold, by existence only: `Presence`, the one place that asks "is this chunk
held?" for the planner's lookup, the saver's skip of stored chunks, explain and `/kv/lookup`.

A chunk is held when some tier holds (or a pending store carries) every stored value of it
(kvkeys/keyspace.py). One batched existence query per tier per call; no value is read.
A `Presence` asks, per tensor-parallel rank, one `HeldKeys` source, over that rank's KV heads:
`LocalHeldKeys` answers from this process's tiers and the keys its store queue still carries
(the worker side's; a planner in the same process asks a `Presence` over it), and
connector/vllm/lookup_channel.py's `LookupClient` asks another process's (vLLM's scheduler asks
each rank's worker over its lookup channel).

The planner's lookup is one question, `Presence.find`: how long a run of a request's chunks is
held, in which tier each is (so a load's hit sources need no second question), and the
longest partial chunk stored where the run stops. Asked of another process it is one round
trip per rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvkeys.keyspace import Keyspace, Span
from kvstore.storage_manager import StorageManager


@dataclass(frozen=True)
class Found:
    """The answer to a lookup (`Presence.find`) over a request's candidate spans: the
    leading run of them held, as the index of the tier a load reads each from (`tiers[i]` for
    span i; a pending store counts as the fastest tier, where it lands first), then, where that
    run stops short, the longest partial chunk stored there, with its tier."""

    tiers: list[int] = field(default_factory=list)
    tier_names: tuple[str, ...] = ()  # fastest first
    partial: Span | None = None
    partial_tier: int = 0

    def tokens_by_tier(self, spans: Sequence[Span], start: int, end: int) -> dict[str, int]:
        """Returns the positions [start, end) of `spans` (the run, then the partial chunk) per
        tier name that holds them."""
        tiers = [*self.tiers, self.partial_tier] if self.partial is not None else self.tiers
        out: dict[str, int] = {}
        for sp, tier in zip(spans, tiers):
            n = min(sp.end, end) - max(sp.start, start)
            if n > 0 and tier < len(self.tier_names):
                name = self.tier_names[tier]
                out[name] = out.get(name, 0) + n
        return out


def find_held(where: Callable[[list[str]], list[int | None]], tier_names: Sequence[str], keyspace: Keyspace,
              tokens: Sequence[int], base: int, spans: Sequence[Span], parent: bytes, after: int) -> Found:
    """Returns the `Found` of `spans` (consecutive, the first after chain `parent`), given
    `where` (per stored key the fastest tier holding it) and `tokens` from position `base`
    through the last span: one `where` for the run, one over the probe keys of the partial
    lengths that end past `after` where it stops short, and one more for the longest of them
    when a chunk is several values."""
    per_key = where(keyspace.stored_keys(spans))
    tiers = keyspace.chunk_tiers(per_key)
    run = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
    found = Found([t for t in tiers[:run] if t is not None], tuple(tier_names))
    if run == len(spans):
        return found
    span = spans[run]
    if span.num_tokens < 2 or span.end - 1 <= after:
        return found
    chain = spans[run - 1].chain if run else parent
    # lengths that would end at or before `after` load nothing
    probe = [sp for sp in keyspace.partial_spans(tokens[span.start - base:span.end - base], span.start, chain)
             if sp.end > after]
    if not probe:
        return found
    probed = where(keyspace.probe_keys(probe))
    held = [i for i, t in enumerate(probed) if t is not None]
    if not held:
        return found
    best, tier = probe[held[-1]], probed[held[-1]]
    if keyspace.values_per_chunk > 1:  # the probe is one of its values: ask for all of them
        tier = keyspace.chunk_tiers(where(keyspace.stored_keys([best])))[0]
    return found if tier is None else Found(found.tiers, found.tier_names, best, tier)


class HeldKeys(ABC):
    """Answers which stored keys one process's tiers hold: the source a `Presence` asks, one per
    tensor-parallel rank. `LocalHeldKeys` asks this process's tiers; connector/vllm/
    lookup_channel.py's `LookupClient` asks another process's, over the lookup channel."""

    @abstractmethod
    def find(self, keyspace: Keyspace, tokens: Sequence[int], base: int, spans: Sequence[Span], parent: bytes,
             after: int) -> Found:
        """Returns how many leading `spans` are held and in which tiers, and the longest stored
        partial chunk where that run stops short (ending past position `after`): `find_held`.
        `tokens` run from position `base` through the last span; `parent` is the chain before
        the first span. Nothing held (or no answer): an empty `Found`."""

    @abstractmethod
    def held(self, keys: Sequence[str]) -> list[bool]:
        """Returns per stored key whether it is held (stored, or carried by a pending store)."""

    @abstractmethod
    def tier_prefix_hits(self, keys: Sequence[str]) -> dict[str, int]:
        """Returns, per tier name (fastest first), how many of `keys` from the start that tier
        holds by itself (pending stores not counted: they are in no tier yet); {} when unknown."""


class LocalHeldKeys(HeldKeys):
    """The held keys of this process's tiers: a storage manager and the keys a store queue
    still carries (`pending`)."""

    def __init__(self, storage: StorageManager, pending: Callable[[str], bool] | None = None) -> None:
        self.storage = storage
        self._pending = pending

    def held(self, keys: Sequence[str]) -> list[bool]:
        """Returns per stored key whether a pending store carries it or some tier holds it
        (one batched query per tier for the keys not pending)."""
        return [w is not None for w in self.where(keys)]

    def where(self, keys: Sequence[str]) -> list[int | None]:
        """Returns per stored key the index of the fastest tier holding it (a pending store's:
        the fastest tier, where it lands first), None where none does."""
        pending = self._pending
        where: list[int | None] = [0 if pending is not None and pending(k) else None for k in keys]
        rest = [k for k, w in zip(keys, where) if w is None]
        if rest:
            found = iter(self.storage.batched_where(rest))
            where = [next(found) if w is None else w for w in where]
        return where

    @property
    def tier_names(self) -> tuple[str, ...]:
        """Returns the tiers' names, fastest first."""
        return tuple(self.storage.names)

    def find(self, keyspace: Keyspace, tokens: Sequence[int], base: int, spans: Sequence[Span], parent: bytes,
             after: int) -> Found:
        return find_held(self.where, self.tier_names, keyspace, tokens, base, spans, parent, after)

    def tier_prefix_hits(self, keys: Sequence[str]) -> dict[str, int]:
        return self.storage.tier_prefix_hits(keys)


class Presence:
    """Which chunks are held, by existence alone: what the planner, the saver, explain and
    `/kv/lookup` ask. Rank r's chunks are asked of `ranks[r]`, a `HeldKeys`, keyed in the
    asker's keyspace narrowed to its KV heads `heads[r]` (no `heads`, or a keyspace not split
    by head: the asker's keyspace as is). A chunk is held when every rank holds its heads of it
    (so every rank can load it); a tier's run is the shortest rank's. One rank: its answers as
    they are."""

    def __init__(self, ranks: Sequence[HeldKeys], heads: Sequence[tuple[int, int]] | None = None) -> None:
        if not ranks or (heads is not None and len(ranks) != len(heads)):
            raise ValueError(f"one head range per rank: {len(ranks)} ranks, "
                             f"{len(ranks) if heads is None else len(heads)} ranges")
        self.ranks = list(ranks)
        self.heads: list[tuple[int, int] | None] = [None] * len(ranks) if heads is None else list(heads)

    def find(self, keyspace: Keyspace, tokens: Sequence[int], base: int, spans: Sequence[Span], parent: bytes,
             after: int) -> Found:
        """The lookup (`HeldKeys.find`), one question per rank over its heads: the run all of
        them hold, each chunk in the slowest rank's tier, and a partial chunk only where every
        rank stops at the same span and holds the same one."""
        answers = [rank.find(self._covering(keyspace, heads), tokens, base, spans, parent, after)
                   for rank, heads in zip(self.ranks, self.heads)]
        if len(answers) == 1:
            return answers[0]
        run = min(len(a.tiers) for a in answers)
        tiers = [max(a.tiers[i] for a in answers) for i in range(run)]
        first = answers[0]
        if first.partial is not None and all(a.partial == first.partial and len(a.tiers) == run for a in answers):
            return Found(tiers, first.tier_names, first.partial, max(a.partial_tier for a in answers))
        return Found(tiers, first.tier_names)

    def chunks_held(self, keyspace: Keyspace, spans: Sequence[Span]) -> list[bool]:
        """Returns per span whether its chunk is held: every stored value of it, on every rank
        (a rank is not asked once no chunk is left)."""
        held = [True] * len(spans)
        for rank, heads in zip(self.ranks, self.heads):
            if any(held):
                ks = self._covering(keyspace, heads)
                answer = ks.chunks_held(rank.held(ks.stored_keys(spans)))
                held = [h and r for h, r in zip(held, answer)]
        return held

    def tier_prefix_chunks(self, keyspace: Keyspace, spans: Sequence[Span]) -> dict[str, int]:
        """Returns, per tier name (fastest first), how many leading spans that tier holds whole
        by itself on every rank (pending stores not counted: they are in no tier yet); {} when
        a rank does not answer."""
        runs = []
        for rank, heads in zip(self.ranks, self.heads):
            ks = self._covering(keyspace, heads)
            hits = rank.tier_prefix_hits(ks.stored_keys(spans))
            runs.append({name: n // ks.values_per_chunk for name, n in hits.items()})
        if not all(runs):
            return {}  # a rank did not answer: nothing is known
        return {name: min(r.get(name, 0) for r in runs) for name in runs[0]}

    @staticmethod
    def _covering(keyspace: Keyspace, heads: tuple[int, int] | None) -> Keyspace:
        """Returns `keyspace` narrowed to a rank's heads (unsplit keyspaces: every value has all)."""
        return keyspace if keyspace.heads is None or heads is None else keyspace.for_heads(*heads)


def held_tokens(spans: Sequence[Span], chunks: dict[str, int], num_tokens: int) -> dict[str, int]:
    """Returns per tier the leading tokens of a `num_tokens`-token sequence that tier holds,
    given per tier how many of its leading `spans` it holds; never the last token (always
    computed)."""
    limit = num_tokens - 1
    return {name: min(spans[n - 1].end, limit) if n else 0 for name, n in chunks.items()}
