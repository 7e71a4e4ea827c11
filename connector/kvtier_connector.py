"""`KVTierConnector`: the engine's KV connector over kvstore tiers
(docs/architecture.md, "Connector").

Flow for one request:
- Lookup (scheduler, `get_num_new_matched_tokens`): chunk keys are chained hashes of the
  tokens keyed by the model fingerprint and KV dtype, so only the same model with the same
  prefix can ever hit. Starting at the chunk that holds the engine's own prefix-cache hit,
  the longest run of chunks some tier holds (or a pending store carries) is taken, capped so
  the last token is computed; where that run stops, the longest stored partial chunk starting
  there is taken too (a prompt that grew, a chat's next round, finds the partial tail its
  last round stored). The answer comes from existence only (one batched query per tier),
  never from fetched bytes, and says `load_async`.
- Load (`update_state_after_alloc`, background, connector/loader.py): the request's chunks
  are pinned and the loader thread fetches them into the request's fresh blocks while the
  engine keeps stepping; `get_finished()` then reports the load. With `use_layerwise` the
  request is scheduled at once instead (the answer says `load_async` False): the loader
  fetches layer by layer (one stored value per layer, connector/layerwise.py) and the
  forward's layer i waits only for layer i (`wait_for_layer_load`). A slow-tier hit is
  promoted to the faster tiers through the store queue, after the load. Existence is not
  possession: a chunk evicted, corrupt or on a tier that died since the lookup stops the load
  there, and `get_block_ids_with_load_errors()` names the blocks from that position on, which
  the engine recomputes (a layerwise step's answer for that request is discarded). An
  aborted request's blocks are released only once the loader let go.
- Store (worker, `wait_for_save`, connector/saver.py): after each step, chunks that became
  complete are gathered once from the paged cache and handed to the store queue's thread, so
  serving never waits on a tier; chunks a tier already holds (or a pending store carries) are
  skipped. A load that needs a chunk still pending waits for those stores on the loader
  thread (read-your-writes), never on the engine's.

The partial-chunk rule (LMCache issue #2206, where a load rounded down to a chunk boundary
and overwrote blocks vLLM's prefix cache owned): this connector writes only positions at or
after the engine's prefix-cache hit, i.e. into blocks freshly allocated to the request and not
yet registered in the prefix cache; a chunk that straddles the hit is sliced at token
granularity and never rewritten from its start. Under that rule a stored partial chunk (keyed
by the chained hash of exactly its tokens) can only be loaded into fresh blocks of a prompt
with the identical prefix, so storing the prompt's partial last chunk is safe and is on by
default (`save_unfull_chunk`).
"""

from __future__ import annotations

import atexit
import functools
import weakref
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from connector.config import ConnectorConfig, make_config
from connector.layerwise import chunks_held, layer_key, stored_keys
from connector.loader import Loader, LoadJob, Span, chunk_ok
from connector.metrics import ConnectorMetrics, RequestKVMetrics, TierKVMetrics
from connector.saver import SavePolicy, Saver, SaveSpec
from connector.store_queue import StoreQueue
from engine.kv_connector import KVConnectorBase
from kvstore.budget_check import check_tier_budgets
from kvstore.keys import (
    ROOT_HASH,
    ChunkKey,
    dtype_name,
    partial_chunk_keys,
    process_tokens,
)
from kvstore.storage_manager import StorageManager

if TYPE_CHECKING:
    from engine.attention_metadata import AttentionMetadata
    from engine.scheduler import SchedulerOutput
    from engine.sequence import Sequence



@dataclass
class _Plan:
    """A lookup's answer for a waiting request: load positions [start, end) from `spans`."""

    num_tokens: int  # sequence length the lookup was made for
    start: int  # the engine's prefix-cache hit the lookup was made against
    end: int
    spans: list[Span] = field(default_factory=list)


@dataclass
class ConnectorMeta:
    """One step's worker-side instructions (built by the scheduler side): the stores and the
    layerwise loads its forward waits for."""

    saves: list[SaveSpec] = field(default_factory=list)
    layer_loads: list[LoadJob] = field(default_factory=list)


class KVTierConnector(KVConnectorBase):
    """Loads stored prefixes into the engine and stores what it computes, across tiers.

    Guarantees: loads write only blocks the request owns beyond the engine's prefix-cache hit,
    off the engine's thread, and report every position they did not fill (recomputed);
    a finished request's blocks are released only after its load stopped writing them; stores
    never block a step (they are dropped, counted, when `max_pending_store_bytes` is queued);
    `shutdown()` flushes them.
    """

    def __init__(self, config: ConnectorConfig | None = None,
                 storage: StorageManager | None = None) -> None:
        self.config = (config or ConnectorConfig()).validate()
        self.chunk_size = self.config.chunk_size
        self.save_decode_tokens = self.config.kvstore.save_decode_tokens
        self._owns_storage = storage is None
        self.storage = storage if storage is not None else StorageManager.from_config(self.config.kvstore)
        self.metrics = ConnectorMetrics()
        self.model_config: Any = None
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = 0
        self._kv_dtype = ""
        self._bytes_per_token = 0
        self.layerwise = self.config.use_layerwise
        self._plans: dict[str, _Plan] = {}  # waiting requests with a lookup answer
        # Blocks not filled by the loads the last get_finished() reported, and by the
        # layerwise loads of the step that just ran.
        self._reported_errors: set[int] = set()
        self._step_errors: set[int] = set()
        self._step_loads: list[LoadJob] = []  # layerwise loads admitted for the coming step
        self.loader: Loader | None = None
        self.saver: Saver | None = None  # created with the caches (the store side)
        self._meta: ConnectorMeta | None = None
        self._stores: StoreQueue | None = None  # created with the caches (needs their device)
        self._closed = False
        # A script that never calls LLM.shutdown() still gets its queued stores written.
        self._atexit = functools.partial(_shutdown_at_exit, weakref.ref(self))
        atexit.register(self._atexit)

    # ---- set-up ----------------------------------------------------------------------
    def register_model(self, model_config: Any) -> None:
        self.model_config = model_config

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        if self.model_config is None:
            raise RuntimeError("register_model must be called before register_kv_caches")
        if not kv_caches:
            raise ValueError("kv_caches is empty")
        if self._stores is not None:
            raise ValueError("this connector already serves an engine; build one per LLM "
                             "(share tiers by passing the same StorageManager)")
        mc = self.model_config
        two, _nb, bs, h, d = kv_caches[0].shape
        if len(kv_caches) != mc.num_layers or (h, d) != (mc.num_kv_heads, mc.head_size):
            raise ValueError(
                f"kv_caches ({len(kv_caches)} x {tuple(kv_caches[0].shape)}) do not match "
                f"the model ({mc.num_layers} layers, {mc.num_kv_heads} kv heads, head size {mc.head_size})"
            )
        if self._owns_storage:  # chunk bytes are known only now; a shared manager's owner checks its own
            per_token = mc.num_layers * two * h * d * kv_caches[0].element_size()
            check_tier_budgets(self.config.kvstore.tiers, per_token * self.chunk_size, kv_caches[0].element_size())
        self.kv_caches = list(kv_caches)
        self.block_size = bs
        self._kv_dtype = dtype_name(kv_caches[0].dtype)
        self._bytes_per_token = mc.num_layers * two * h * d * kv_caches[0].element_size()
        self._stores = StoreQueue(self.storage, self.config.kvstore.queue_size,
                                  self.config.max_pending_store_bytes, kv_caches[0].device,
                                  self.config.kvstore.queue_full)
        self.loader = Loader(self.storage, self._stores, self.kv_caches, bs, self.metrics)
        policy = SavePolicy(self.chunk_size, self.save_decode_tokens, self.config.save_unfull_chunk)
        self.saver = Saver(policy, self._spans, self.storage, self._stores, self.kv_caches, bs,
                           self._layers(), self.metrics)

    def _spans(self, tokens: SequenceT[int], unfull: bool = True) -> list[Span]:
        """Returns every chunk span of `tokens` with its key (the partial last one if `unfull`)."""
        if self.model_config is None:
            raise RuntimeError("the connector is not attached to an engine (register_model)")
        return [(s, e, k.to_str()) for s, e, k in process_tokens(
            tokens, self.chunk_size, model=self.model_config.fingerprint, kv_dtype=self._kv_dtype,
            save_unfull_chunk=unfull)]

    def _queue(self) -> StoreQueue:
        """Returns the store queue; RuntimeError before `register_kv_caches` created it."""
        if self._stores is None:
            raise RuntimeError("the connector has no KV caches yet (register_kv_caches)")
        return self._stores

    def _saver(self) -> Saver:
        """Returns the store side; RuntimeError before `register_kv_caches` created it."""
        if self.saver is None:
            raise RuntimeError("the connector has no KV caches yet (register_kv_caches)")
        return self.saver

    def _chunk_ok(self, kv: torch.Tensor | None, num_tokens: int) -> TypeGuard[torch.Tensor]:
        """Whether a fetched value has exactly the shape this model's chunk must have."""
        mc = self.model_config
        return chunk_ok(kv, (mc.num_layers, 2, num_tokens, mc.num_kv_heads, mc.head_size))

    def _layers(self) -> int | None:
        """Returns the stored values per chunk's layers in layerwise mode, else None (one value)."""
        return self.model_config.num_layers if self.layerwise else None

    # ---- scheduler side --------------------------------------------------------------
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        """Returns (how many tokens after `num_computed_tokens` some tier holds, whether they
        load in the background: True, or layerwise in the request's first step: False), from
        existence only; (0, False) on a miss. Never reaches the last token."""
        rid = seq.request_id
        n = seq.num_tokens
        plan = self._plans.get(rid)
        if plan is not None and (plan.num_tokens, plan.start) == (n, num_computed_tokens):
            return plan.end - plan.start, not self.layerwise
        self._plans.pop(rid, None)
        limit = n - 1  # the last token's logits are needed
        if limit <= num_computed_tokens:
            return 0, False
        m = self.metrics.live(rid)
        m.num_prompt_tokens = seq.num_prompt_tokens
        m.engine_hit_tokens = num_computed_tokens
        spans = self._spans(seq.all_token_ids)
        first = num_computed_tokens // self.chunk_size
        candidates = [sp for sp in spans[first:] if sp[0] < limit]
        if not candidates:
            return 0, False
        held = self._held([k for _, _, k in candidates])
        num_hit = held.index(False) if False in held else len(held)
        wanted = candidates[:num_hit]
        if num_hit < len(candidates):
            tail = self._stored_partial(seq.all_token_ids, spans, first + num_hit, num_computed_tokens)
            if tail is not None:
                wanted.append(tail)
        end = min(wanted[-1][1], limit) if wanted else num_computed_tokens
        if end <= num_computed_tokens:
            return 0, False
        self._plans[rid] = _Plan(n, num_computed_tokens, end, wanted)
        return end - num_computed_tokens, not self.layerwise

    def _held(self, keys: list[str], one_layer: bool = False) -> list[bool]:
        """Returns, per chunk key, whether a pending store carries it or some tier holds it
        (all its layers in layerwise mode, or only the last with `one_layer`; one batched
        existence query per tier for the rest)."""
        if one_layer and self.layerwise:
            values = [layer_key(k, self.model_config.num_layers - 1) for k in keys]
            held = [self._queue().is_pending(k) for k in values]
            rest = [k for k, h in zip(values, held) if not h]
            found = iter(self.storage.batched_contains(rest) if rest else [])
            return [h or next(found) for h in held]
        values = stored_keys(keys, self._layers())
        held = [self._queue().is_pending(k) for k in values]
        rest = [k for k, h in zip(values, held) if not h]
        if rest:
            found = iter(self.storage.batched_contains(rest))
            held = [h or next(found) for h in held]
        return chunks_held(held, self._layers())

    def _stored_partial(self, tokens: SequenceT[int], spans: list[Span], j: int, after: int) -> Span | None:
        """Returns the longest stored partial chunk that starts where span `j` starts and ends
        past position `after`, or None: one batched existence query over its possible lengths
        (layerwise: over their last layers, then one for all layers of the longest)."""
        s, e, _ = spans[j]
        if e - s < 2 or e - 1 <= after:
            return None
        parent = ROOT_HASH if j == 0 else ChunkKey.from_str(spans[j - 1][2]).chunk_hash
        skip = max(0, after - s)  # lengths that would end at or before `after` load nothing
        probe = [k.to_str() for k in partial_chunk_keys(
            tokens[s:e], self.chunk_size, parent_hash=parent, model=self.model_config.fingerprint,
            kv_dtype=self._kv_dtype)][skip:]
        held = [i for i, present in enumerate(self._held(probe, one_layer=True)) if present]
        if not held or (self.layerwise and not self._held([probe[held[-1]]])[0]):
            return None
        return s, s + skip + held[-1] + 1, probe[held[-1]]

    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_external_tokens: int) -> None:
        """Pins the request's chunks and starts its load into `block_ids` (layerwise: the
        coming step's forward waits for it layer by layer)."""
        rid = seq.request_id
        plan = self._plans.pop(rid, None)
        if num_external_tokens <= 0:
            return
        loader = self.loader
        if loader is None:
            raise RuntimeError("the connector has no KV caches yet (register_kv_caches)")
        if plan is None or plan.start + num_external_tokens > plan.end:
            raise RuntimeError(f"request {rid}: asked to load {num_external_tokens} tokens "
                               "the connector did not offer")
        end = plan.start + num_external_tokens
        job = LoadJob(rid, plan.start, end, [sp for sp in plan.spans if sp[0] < end], list(block_ids),
                      layerwise=self.layerwise)
        if job.layerwise:
            self._step_loads.append(job)
        loader.submit(job)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """Returns (None, the requests whose background load ended since the last call); their
        failed blocks are what `get_block_ids_with_load_errors()` returns next."""
        done = self.loader.finished() if self.loader is not None else {}
        self._reported_errors = set().union(*done.values()) if done else set()
        return None, set(done)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Returns the blocks the loads last reported by `get_finished()` did not fill, and
        (called after a step) those the step's layerwise loads did not fill."""
        errors = self._reported_errors | self._step_errors
        self._reported_errors, self._step_errors = set(), set()
        return errors

    def wait_for_finished(self, timeout: float) -> None:
        """Blocks until a background load has ended (or `timeout` seconds passed)."""
        if self.loader is not None:
            self.loader.wait_for_finished(timeout)

    def loads_in_flight(self) -> int:
        """Returns how many loads have not ended yet."""
        return self.loader.in_flight() if self.loader is not None else 0

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMeta:
        """Returns the spans to store once the step has computed them and the layerwise loads
        its forward waits for (background loads are not the step's)."""
        meta = ConnectorMeta(layer_loads=self._step_loads)
        self._step_loads = []
        for r in scheduler_output.requests:
            spans = self._saver().spans_to_save(r.seq, r.num_computed_tokens + r.num_new_tokens)
            if spans:
                meta.saves.append(SaveSpec(r.request_id, list(r.block_ids), spans))
        return meta

    def request_finished(self, seq: Sequence, block_ids: list[int]) -> bool:
        """Stores the generated tail if configured; returns True (free the blocks later) if
        the request's load is still writing them: the load stops at its next chunk."""
        rid = seq.request_id
        self._plans.pop(rid, None)
        # In flight: reported by get_finished() once the loader let go of the blocks.
        in_flight = self.loader is not None and self.loader.cancel(rid)
        try:
            if self.saver is not None:
                self.saver.finish(seq, block_ids, store_tail=not in_flight)
        finally:
            self.metrics.finish(rid)
        return in_flight

    # ---- worker side -----------------------------------------------------------------
    def bind_connector_metadata(self, metadata: Any) -> None:
        self._meta = metadata

    def clear_connector_metadata(self) -> None:
        """Drops the step's metadata; a layerwise load the step left running (its forward
        failed) is cancelled and waited for, so nothing writes the blocks after the step."""
        meta, self._meta = self._meta, None
        if meta is not None and self.loader is not None:
            for job in meta.layer_loads:
                job.cancelled = True
                self.loader.wait_ended(job)

    def start_load_kv(self, attn_metadata: AttentionMetadata) -> None:
        """Nothing: loads were started at admission (in the background, or layerwise on the
        loader thread ahead of this forward)."""

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Blocks until layer `layer_idx` of this step's layerwise loads is in place (or given up)."""
        if self._meta is not None and self.loader is not None:
            for job in self._meta.layer_loads:
                self.loader.wait_layer(job, layer_idx)

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata) -> None:
        """Nothing per layer: whole chunks are gathered across layers after the forward."""

    def wait_for_save(self) -> None:
        """Collects this step's layerwise loads (what did not arrive is reported by
        `get_block_ids_with_load_errors()`), then gathers the step's storable chunks and queues
        them, skipping requests whose load failed (their step computed over K/V that never
        arrived); returns without waiting for any tier."""
        if self._meta is None:
            return
        failed: dict[str, int] = {}
        for job in self._meta.layer_loads:
            if self.loader is None:
                break
            self.loader.wait_ended(job)
            bad = self.loader.bad_blocks(job)
            if bad:
                self._step_errors |= bad
                failed[job.request_id] = job.filled
        for rid, filled in failed.items():  # what it computes again is considered again
            self._saver().rewind(rid, filled)
        for save in self._meta.saves:
            if save.request_id not in failed:  # a failed one's are stored once recomputed
                self._saver().store(save)

    # ---- lifecycle and reporting ----------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Waits until queued stores reached every tier; returns False on timeout."""
        ok = self._stores is None or self._stores.flush(timeout)
        return self.storage.flush(timeout) and ok

    def shutdown(self) -> None:
        """Flushes pending stores and closes the tiers this connector opened."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        if self.loader is not None:
            self.loader.close()  # loads in flight end (and unpin) first
        if self._stores is not None:
            self._stores.close()
        self.storage.flush()
        if self._owns_storage:
            self.storage.close()

    def request_metrics(self, request_id: str) -> RequestKVMetrics:
        """Returns a request's connector metrics (live or recently finished; all zero for a
        request the connector never saw or has forgotten)."""
        return self.metrics.request(request_id) or RequestKVMetrics(request_id)

    def tier_metrics(self) -> list[TierKVMetrics]:
        """Returns per-tier totals, fastest tier first."""
        return [TierKVMetrics.from_stats(s, self._bytes_per_token) for s in self.storage.stats().values()]

    def pending_stores(self) -> int:
        """Returns how many gathered chunks wait for the store thread."""
        return 0 if self._stores is None else self._stores.pending()


def _shutdown_at_exit(ref: weakref.ref[KVTierConnector]) -> None:
    conn = ref()
    if conn is not None:
        conn.shutdown()


def build_connector(config_or_urls: Any = None, *, storage: StorageManager | None = None,
                    **overrides: Any) -> KVTierConnector:
    """Returns a connector for `LLM(kv_connector=...)` from a ConnectorConfig, KVStoreConfig,
    mapping, YAML path, tier URL or list of tier URLs (fastest first); `overrides` are
    `make_config` keywords (chunk_size, codec, save_decode_tokens, save_unfull_chunk)."""
    if isinstance(config_or_urls, KVTierConnector):
        if overrides or storage is not None:
            raise ValueError("a ready connector takes no overrides")
        return config_or_urls
    cfg = make_config(config_or_urls, **overrides)
    if cfg.blend.enabled:  # CacheBlend builds on this connector (connector.blend)
        from connector.blend.blend_connector import BlendConnector

        return BlendConnector(cfg, storage=storage)
    return KVTierConnector(cfg, storage=storage)
