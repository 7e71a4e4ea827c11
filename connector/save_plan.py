"""The scheduler side's save planning: which chunks of a request became storable with a
step, each offered once (docs/architecture.md, "Connector").

Storable are full prompt chunks, the prompt's partial last chunk (`save_unfull_chunk`) and,
with `save_decode_tokens`, full decode chunks, and at finish the generated partial tail. The
worker side skips what a tier (or a pending store) already holds; this side only remembers,
per request, up to where it has offered chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvkeys.keyspace import Keyspace, RequestSpans, Span

if TYPE_CHECKING:
    from connector.request_view import RequestView


@dataclass
class SavePolicy:
    """What gets stored: decode tokens too, the prompt's partial last chunk."""

    save_decode_tokens: bool
    save_unfull_chunk: bool
    enabled: bool = True  # False: nothing is offered (a consumer-only connector)


class SavePlan:
    """Per request, the position up to which chunks were offered. Guarantees: a span is
    offered once unless `rewind` says it is computed again."""

    def __init__(self, policy: SavePolicy, keyspace: Keyspace,
                 spans_of: Callable[[RequestView], RequestSpans]) -> None:
        self.policy = policy
        self.keyspace = keyspace
        self._spans_of = spans_of  # the planner's per-request spans: no chunk is hashed twice
        self._saved_upto: dict[str, int] = {}

    def skip_to(self, request_id: str, position: int) -> None:
        """Marks the request's chunks before the chunk holding `position` as offered (they
        were loaded from a tier: no need to store them again)."""
        cs = self.keyspace.chunk_size
        self._saved_upto[request_id] = max(self._saved_upto.get(request_id, 0), position // cs * cs)

    def spans_to_save(self, seq: RequestView, computed: int) -> list[Span]:
        """Returns the spans that became storable with `computed` tokens in the cache, not
        offered before; marks them offered."""
        if not self.policy.enabled:
            return []
        rid = seq.request_id
        done = self._saved_upto.get(rid, 0)
        p = seq.num_prompt_tokens
        cs = self.keyspace.chunk_size
        # Decode tokens only in whole chunks here; their partial tail is saved at finish.
        limit = computed if self.policy.save_decode_tokens else min(computed, p)
        full_end = limit // cs * cs
        unfull = self.policy.save_unfull_chunk and computed >= p and p % cs and limit == p
        new_end = p if unfull and p > full_end else full_end
        if new_end <= done:
            return []
        self._saved_upto[rid] = new_end
        spans = self._spans_of(seq).spans(seq.all_token_ids[:new_end], bool(unfull))
        return [sp for sp in spans if sp.end > done]

    def rewind(self, request_id: str, position: int) -> None:
        """Offers the request's chunks from the one holding `position` again (recomputed)."""
        if request_id in self._saved_upto:
            cs = self.keyspace.chunk_size
            self._saved_upto[request_id] = min(self._saved_upto[request_id], position // cs * cs)

    def finish(self, seq: RequestView, num_blocks: int, block_size: int) -> list[Span]:
        """Forgets the request; returns its generated tail's spans to store, if configured
        (only positions its `num_blocks` blocks still hold)."""
        rid = seq.request_id
        done = self._saved_upto.pop(rid, 0)
        p = self.policy
        if not (p.enabled and p.save_decode_tokens and p.save_unfull_chunk and num_blocks):
            return []
        computed = min(seq.num_computed_tokens, num_blocks * block_size)
        if computed <= done:
            return []
        spans = self._spans_of(seq).spans(seq.all_token_ids[:computed], True)
        return [sp for sp in spans if sp.end > done]

    def forget(self, request_id: str) -> None:
        """Drops the request's record."""
        self._saved_upto.pop(request_id, None)
