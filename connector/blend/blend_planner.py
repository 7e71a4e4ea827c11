"""CacheBlend's scheduler side: plans blends of segmented prompts (docs/architecture.md,
"CacheBlend"), the prefix path's extension (connector/extension.py) when `blend.enabled`.

- Lookup: it takes the requests of kvtier's engine whose prompt has a context segment and a
  query. The context, every segment but the query (and never the last token), is reported
  loadable from where the engine's own prefix cache stops, in the request's first step (not
  async). A segment missing from every tier is computed by the worker, so the answer never
  over-promises.
- Blended K/V is approximate: the request's `max_cacheable_tokens` stops the engine's prefix
  cache at the exact part (the engine's hit; the first segment, since at position 0 its
  stored K/V is its standalone K/V; and, in context, the segments after it that no tier held
  at admission, computed in this prompt over exact K/V: a cold prompt is cached whole), and
  blended requests are never stored as prefix chunks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from connector.blend.blend_config import BlendConfig, engine_model
from connector.blend.executor import check_rope_moves
from connector.blend.segments import BlendSpec, context_segments
from connector.connector_metrics import ConnectorMetrics
from connector.extension import PlannerExtension
from connector.presence import Presence
from engine.kv_cache import KeyedModel
from engine.sequence import Sequence
from kvkeys.keyspace import Keyspace

if TYPE_CHECKING:
    from connector.request_view import RequestView
    from engine.scheduler_output import SchedulerOutput


class BlendPlanner(PlannerExtension):
    """Per request: looked up, admitted (blended in the coming step), live and blended."""

    def __init__(self, config: BlendConfig, presence: Presence, metrics: ConnectorMetrics) -> None:
        self.config = config
        self.presence = presence
        self.metrics = metrics
        self._keyspace: Keyspace | None = None
        self.block_size = 0
        self._planned: dict[str, BlendSpec] = {}  # looked up, not yet admitted
        self._admitted: dict[str, BlendSpec] = {}  # admitted, blended in the coming step
        self._blended: set[str] = set()  # live requests holding blended K/V
        self.segment_separator = config.separator

    def register_model(self, model_config: KeyedModel, keyspace: Keyspace, block_size: int) -> None:
        """Checks that CacheBlend can serve the model (kvtier's engine's); raises ValueError if not."""
        model = engine_model(model_config)
        check_rope_moves(model)
        self.config.validate(model.num_layers)
        self._keyspace = keyspace
        self.block_size = block_size

    @staticmethod
    def applies(seq: Sequence) -> bool:
        """Whether `seq` is blended: its prompt has a context segment and a query."""
        return bool(seq.segment_lens) and len(seq.segment_lens or ()) >= 2

    def match(self, seq: RequestView, num_computed_tokens: int) -> tuple[int, bool] | None:
        """Returns (the context tokens after the engine's hit, False: blended in the step) for
        a segmented request of kvtier's engine, None for any other."""
        if not (isinstance(seq, Sequence) and self.applies(seq)):
            return None
        rid = seq.request_id
        self._planned.pop(rid, None)
        lens = seq.segment_lens or []
        end = min(sum(lens[:-1]), seq.num_tokens - 1)
        if end <= num_computed_tokens:
            return 0, False
        self._planned[rid] = BlendSpec(rid, num_computed_tokens, end, context_segments(lens), 0, [], [],
                                       seq.cache_salt)
        m = self.metrics.live(rid)
        m.num_prompt_tokens, m.engine_hit_tokens = seq.num_prompt_tokens, num_computed_tokens
        return end - num_computed_tokens, False

    def admit(self, seq: RequestView, block_ids: list[int], num_external_tokens: int) -> bool:
        """Admits the request's planned blend (False: none is planned) for the coming step and
        caps the engine's prefix cache at its exact part."""
        if seq.request_id not in self._planned or not isinstance(seq, Sequence):
            return False
        spec = self._planned.pop(seq.request_id)
        if num_external_tokens <= 0:
            return True
        spec.end = min(spec.end, spec.start + num_external_tokens)
        spec.exact_end = min(self._exact_end(seq, spec), spec.end)
        self._admitted[seq.request_id] = spec
        self._blended.add(seq.request_id)
        seq.max_cacheable_tokens = max(spec.start, spec.exact_end // self.block_size * self.block_size)
        return True

    def _exact_end(self, seq: Sequence, spec: BlendSpec) -> int:
        """Returns where the exact part of a blend ends: past the engine's hit, the first
        segment and, in context, every following segment up to the first that a tier holds
        (one existence query)."""
        exact = spec.start
        todo = [g for g in spec.segments if g.end > exact]
        if todo and todo[0].index == 0:
            exact = todo.pop(0).end
        if self.config.segment_kv != "in_context" or not todo or self._keyspace is None:
            return exact
        ks = self._keyspace.for_salt(seq.cache_salt)
        spans = [ks.segment_spans(seq.token_ids_slice(g.start, g.end), "in_context") for g in todo]
        held = iter(self.presence.chunks_held(ks, [sp for group in spans for sp in group]))
        for g, group in zip(todo, spans):
            if all([next(held) for _ in group]):  # a tier holds it: blended from here on
                break
            exact = g.end
        return exact

    def step_work(self, scheduler_output: SchedulerOutput) -> list[BlendSpec]:
        """Returns this step's blends, with their tokens and block tables."""
        out: list[BlendSpec] = []
        for r in scheduler_output.requests:
            spec = self._admitted.pop(r.request_id, None)
            if spec is not None:
                spec.token_ids = r.seq.token_ids_slice(0, spec.end)
                spec.block_ids = list(r.block_ids)
                out.append(spec)
        self._admitted.clear()
        return out

    def excludes_saves(self, request_id: str) -> bool:
        """Whether the request holds blended (approximate) K/V."""
        return request_id in self._blended

    def num_live(self) -> int:
        """Returns how many requests this planner still tracks (planned, admitted or blended)."""
        return len(self._planned.keys() | self._admitted.keys() | self._blended)

    def finish(self, request_id: str) -> bool:
        """Forgets the request; returns whether it was blended."""
        self._planned.pop(request_id, None)
        self._admitted.pop(request_id, None)
        if request_id in self._blended:
            self._blended.discard(request_id)
            return True
        return False
