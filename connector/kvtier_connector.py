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
- Load (`update_state_after_alloc`, background): the request's chunks are pinned and a
  loader thread fetches them (FETCH_GROUP at a time, the next group on a prefetch thread
  while this one is scattered) into the request's fresh blocks while the engine keeps
  stepping; `get_finished()` then reports the load. A slow-tier hit is promoted to the faster
  tiers by that fetch, on the loader's thread, never on the engine's. Existence is not
  possession: a chunk evicted, corrupt or on a tier that died since the lookup stops the load
  there, and `get_block_ids_with_load_errors()` names the blocks from that position on, which
  the engine recomputes. An aborted request's blocks are released only once the loader let go.
- Store (worker, `wait_for_save`): after each step, chunks that became complete (full prompt
  chunks, the prompt's partial last chunk, decode chunks if enabled) are gathered from the
  paged cache and handed to a background thread, so serving never waits on a tier. Chunks a
  tier already holds (or a pending store carries) are skipped. A load that needs a chunk
  still pending waits for those stores on the loader thread (read-your-writes), never on the
  engine's.

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
import contextlib
import functools
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from collections.abc import Sequence as SequenceT
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from connector.config import ConnectorConfig, make_config
from connector.gather import gather_chunk, scatter_chunk, slots_for
from connector.metrics import ConnectorMetrics, RequestKVMetrics, TierKVMetrics
from connector.store_queue import StoreQueue
from engine.kv_connector import KVConnectorBase
from kvstore.keys import (
    ROOT_HASH,
    ChunkKey,
    dtype_name,
    partial_chunk_keys,
    process_tokens,
)
from kvstore.storage_manager import StorageManager
from kvstore.writer import BackgroundWriter

if TYPE_CHECKING:
    from engine.attention_metadata import AttentionMetadata
    from engine.scheduler import SchedulerOutput
    from engine.sequence import Sequence

# (start, end, key): token positions [start, end) of a sequence and the chunk key for them.
Span = tuple[int, int, str]
# Background loads queued at most; one past it is refused and computed instead.
LOAD_QUEUE_SIZE = 4096
# Chunks per fetch of a load: the next group is fetched while this one is scattered.
FETCH_GROUP = 2
logger = logging.getLogger("kvtier.connector")


@dataclass
class _Plan:
    """A lookup's answer for a waiting request: load positions [start, end) from `spans`."""

    num_tokens: int  # sequence length the lookup was made for
    start: int  # the engine's prefix-cache hit the lookup was made against
    end: int
    spans: list[Span] = field(default_factory=list)


@dataclass
class LoadJob:
    """One background load: positions [start, end) of a request into its fresh blocks."""

    request_id: str
    start: int
    end: int
    spans: list[Span]  # in order, covering [start, end) (the first may begin before start)
    block_ids: list[int]
    cancelled: bool = False  # the request finished: stop writing its blocks
    # CUDA: recorded on the engine's stream at admission; the load stream waits for it, so
    # kernels still using these blocks for their previous owner finish before they are written.
    ready: Any = None

    @property
    def keys(self) -> list[str]:
        return [k for _, _, k in self.spans]


@dataclass
class SaveSpec:
    request_id: str
    block_ids: list[int]
    spans: list[Span]


@dataclass
class ConnectorMeta:
    """One step's worker-side instructions (built by the scheduler side): the stores."""

    saves: list[SaveSpec] = field(default_factory=list)


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
        self._plans: dict[str, _Plan] = {}  # waiting requests with a lookup answer
        # Background loads: jobs in flight, loads ended but not yet reported (with the blocks
        # they failed to fill), and the blocks of the loads the last get_finished() reported.
        self._load_cond = threading.Condition()
        self._loading: dict[str, LoadJob] = {}
        self._loads_done: dict[str, set[int]] = {}
        self._reported_errors: set[int] = set()
        self._loader: BackgroundWriter | None = None
        self._load_stream: Any = None
        self._saved_upto: dict[str, int] = {}  # per request: positions already considered
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
        self.kv_caches = list(kv_caches)
        self.block_size = bs
        self._kv_dtype = dtype_name(kv_caches[0].dtype)
        self._bytes_per_token = mc.num_layers * two * h * d * kv_caches[0].element_size()
        self._stores = StoreQueue(self.storage, self.config.kvstore.queue_size,
                                  self.config.max_pending_store_bytes, kv_caches[0].device,
                                  self.config.kvstore.queue_full)
        # A full load queue refuses a job; that load is reported failed (recomputed).
        self._loader = BackgroundWriter(LOAD_QUEUE_SIZE, "drop_new", "kvtier-connector-load")
        self._prefetch = ThreadPoolExecutor(1, thread_name_prefix="kvtier-connector-fetch")
        if kv_caches[0].device.type == "cuda":
            self._load_stream = torch.cuda.Stream(kv_caches[0].device)

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

    def _chunk_ok(self, kv: torch.Tensor | None, num_tokens: int) -> TypeGuard[torch.Tensor]:
        """Whether a fetched value has exactly the shape this model's chunk must have."""
        if not isinstance(kv, torch.Tensor) or not kv.is_floating_point():
            return False
        mc = self.model_config
        return tuple(kv.shape) == (mc.num_layers, 2, num_tokens, mc.num_kv_heads, mc.head_size)

    # ---- scheduler side --------------------------------------------------------------
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        """Returns (how many tokens after `num_computed_tokens` some tier holds, True: they
        load in the background), from existence only; (0, False) on a miss. Never reaches
        the last token."""
        rid = seq.request_id
        n = seq.num_tokens
        plan = self._plans.get(rid)
        if plan is not None and (plan.num_tokens, plan.start) == (n, num_computed_tokens):
            return plan.end - plan.start, True
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
        return end - num_computed_tokens, True

    def _held(self, keys: list[str]) -> list[bool]:
        """Returns, per key, whether a pending store carries it or some tier holds it (one
        batched existence query per tier for the rest)."""
        held = [self._queue().is_pending(k) for k in keys]
        rest = [k for k, h in zip(keys, held) if not h]
        if rest:
            found = iter(self.storage.batched_contains(rest))
            held = [h or next(found) for h in held]
        return held

    def _stored_partial(self, tokens: SequenceT[int], spans: list[Span], j: int, after: int) -> Span | None:
        """Returns the longest stored partial chunk that starts where span `j` starts and ends
        past position `after`, or None: one batched existence query over its possible lengths."""
        s, e, _ = spans[j]
        if e - s < 2 or e - 1 <= after:
            return None
        parent = ROOT_HASH if j == 0 else ChunkKey.from_str(spans[j - 1][2]).chunk_hash
        skip = max(0, after - s)  # lengths that would end at or before `after` load nothing
        probe = [k.to_str() for k in partial_chunk_keys(
            tokens[s:e], self.chunk_size, parent_hash=parent, model=self.model_config.fingerprint,
            kv_dtype=self._kv_dtype)][skip:]
        held = [i for i, present in enumerate(self._held(probe)) if present]
        if not held:
            return None
        return s, s + skip + held[-1] + 1, probe[held[-1]]

    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_external_tokens: int) -> None:
        """Pins the request's chunks and starts its background load into `block_ids`."""
        rid = seq.request_id
        plan = self._plans.pop(rid, None)
        if num_external_tokens <= 0:
            return
        loader = self._loader
        if loader is None:
            raise RuntimeError("the connector has no KV caches yet (register_kv_caches)")
        if plan is None or plan.start + num_external_tokens > plan.end:
            raise RuntimeError(f"request {rid}: asked to load {num_external_tokens} tokens "
                               "the connector did not offer")
        end = plan.start + num_external_tokens
        job = LoadJob(rid, plan.start, end, [sp for sp in plan.spans if sp[0] < end], list(block_ids))
        self.storage.pin(job.keys)  # no local tier evicts them before the loader reads them
        if self._load_stream is not None:
            job.ready = torch.cuda.Event()
            job.ready.record()
        with self._load_cond:
            self._loading[rid] = job
        if not loader.submit(functools.partial(self._load, job)):
            self._end_load(job, job.start)  # load queue full: computed instead

    def _load(self, job: LoadJob) -> None:
        """Runs on the loader thread: fetches the job's chunks and scatters them in order,
        stopping at the first chunk that is missing or malformed; then reports the job."""
        filled = job.start
        t0 = time.perf_counter()
        nbytes = 0
        try:
            if not job.cancelled:
                self._queue().wait_for(job.keys)  # read-your-writes, on this thread
                stream = self._load_stream
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    if job.ready is not None:
                        stream.wait_event(job.ready)
                    for span, kv in self._fetch_pipelined(job):
                        s, e, _ = span
                        if job.cancelled or not self._chunk_ok(kv, e - s):
                            break  # corrupt, evicted or foreign: computed from here on
                        lo, hi = max(s, job.start), min(e, job.end)
                        scatter_chunk(self.kv_caches, slots_for(job.block_ids, self.block_size, lo, hi),
                                      kv[:, :, lo - s:hi - s])
                        nbytes += kv.numel() * kv.element_size()
                        filled = hi
                    if stream is not None:
                        stream.synchronize()  # in place before the engine may read the blocks
        except Exception:  # a failed load is a recompute, never a crash of the loader
            logger.exception("loading request %s failed", job.request_id)
        finally:
            self.metrics.add(job.request_id, bytes_loaded=nbytes, load_seconds=time.perf_counter() - t0)
            self._end_load(job, filled)

    def _fetch_pipelined(self, job: LoadJob) -> Iterator[tuple[Span, torch.Tensor | None]]:
        """Yields each span of `job` with its fetched value (None: missing), in order. Groups
        of FETCH_GROUP chunks are fetched one batched call each, the next group on the
        prefetch thread while the caller scatters this one; stops fetching once the job is
        cancelled or a group comes back short."""
        groups = [job.spans[i:i + FETCH_GROUP] for i in range(0, len(job.spans), FETCH_GROUP)]
        get = functools.partial(self.storage.batched_get, read_only=True)  # only scattered
        pending = self._prefetch.submit(get, [k for _, _, k in groups[0]])
        for g, group in enumerate(groups):
            values = pending.result()
            last = g + 1 == len(groups) or job.cancelled or any(v is None for v in values)
            if not last:
                pending = self._prefetch.submit(get, [k for _, _, k in groups[g + 1]])
            yield from zip(group, values)
            if last:
                return

    def _end_load(self, job: LoadJob, filled: int) -> None:
        """Unpins the job's chunks and queues its report: the blocks from `filled` on failed."""
        self.storage.unpin(job.keys)
        bad: set[int] = set()
        if filled < job.end and not job.cancelled:
            bad = set(job.block_ids[filled // self.block_size: -(-job.end // self.block_size)])
        rid = job.request_id
        if not job.cancelled:
            self.metrics.add(rid, connector_hit_tokens=filled - job.start, load_error_tokens=job.end - filled)
        with self._load_cond:
            if self._loading.get(rid) is job:
                del self._loading[rid]
                self._loads_done[rid] = bad
            self._load_cond.notify_all()

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """Returns (None, the requests whose load ended since the last call); their failed
        blocks are what `get_block_ids_with_load_errors()` returns next."""
        with self._load_cond:
            done, self._loads_done = self._loads_done, {}
        self._reported_errors = set().union(*done.values()) if done else set()
        return None, set(done)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Returns the blocks the loads last reported by `get_finished()` did not fill."""
        errors, self._reported_errors = self._reported_errors, set()
        return errors

    def wait_for_finished(self, timeout: float) -> None:
        """Blocks until a load has ended (or `timeout` seconds passed)."""
        with self._load_cond:
            self._load_cond.wait_for(lambda: bool(self._loads_done), timeout)

    def loads_in_flight(self) -> int:
        """Returns how many background loads have not ended yet."""
        with self._load_cond:
            return len(self._loading)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMeta:
        """Returns the spans to store once the step has computed them (loads are not the
        step's: they run in the background)."""
        meta = ConnectorMeta()
        for r in scheduler_output.requests:
            spans = self._spans_to_save(r.seq, r.num_computed_tokens + r.num_new_tokens)
            if spans:
                meta.saves.append(SaveSpec(r.request_id, list(r.block_ids), spans))
        return meta

    def _spans_to_save(self, seq: Sequence, computed: int) -> list[Span]:
        """Returns the spans that became storable with `computed` tokens in the cache and that
        no tier (nor a pending store) holds yet; marks them considered."""
        rid = seq.request_id
        done = self._saved_upto.get(rid, 0)
        p = seq.num_prompt_tokens
        cs = self.chunk_size
        # Decode tokens only in whole chunks here; their partial tail is saved at finish.
        limit = computed if self.save_decode_tokens else min(computed, p)
        full_end = limit // cs * cs
        unfull = self.config.save_unfull_chunk and computed >= p and p % cs and limit == p
        new_end = p if unfull and p > full_end else full_end
        if new_end <= done:
            return []
        self._saved_upto[rid] = new_end
        spans = [sp for sp in self._spans(seq.token_ids_slice(0, new_end), unfull=bool(unfull))
                 if sp[1] > done]
        return self._not_stored(spans)

    def _not_stored(self, spans: list[Span]) -> list[Span]:
        """Returns the spans neither a tier nor a pending store holds (stored prefix skipped)."""
        spans = [sp for sp in spans if not self._queue().is_pending(sp[2])]
        if not spans:
            return spans
        return spans[self.storage.prefix_hits([k for _, _, k in spans]):]

    def request_finished(self, seq: Sequence, block_ids: list[int]) -> bool:
        """Stores the generated tail if configured; returns True (free the blocks later) if
        the request's load is still writing them: the load stops at its next chunk."""
        rid = seq.request_id
        self._plans.pop(rid, None)
        with self._load_cond:
            job = self._loading.get(rid)
            if job is not None:  # reported by get_finished() once the loader let go of the blocks
                job.cancelled = True
            else:
                self._loads_done.pop(rid, None)  # ended, not reported: its blocks are free to go
        if job is not None:
            self._saved_upto.pop(rid, None)
            self.metrics.finish(rid)
            return True
        try:
            if self.save_decode_tokens and self.config.save_unfull_chunk and block_ids:
                # The tail chunk of the generated text, from blocks still held during this call.
                computed = min(seq.num_computed_tokens, len(block_ids) * self.block_size)
                done = self._saved_upto.get(rid, 0)
                if computed > done:
                    spans = [sp for sp in self._spans(seq.token_ids_slice(0, computed)) if sp[1] > done]
                    self._store(SaveSpec(rid, list(block_ids), self._not_stored(spans)))
        finally:
            self._saved_upto.pop(rid, None)
            self.metrics.finish(rid)
        return False

    # ---- worker side -----------------------------------------------------------------
    def bind_connector_metadata(self, metadata: Any) -> None:
        self._meta = metadata

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self, attn_metadata: AttentionMetadata) -> None:
        """Nothing: this connector's loads run in the background before a request is scheduled."""

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Nothing to wait for: a request runs only once its load has ended."""

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata) -> None:
        """Nothing per layer: whole chunks are gathered across layers after the forward."""

    def wait_for_save(self) -> None:
        """Gathers this step's storable chunks and queues them; returns without waiting for
        any tier."""
        if self._meta is None:
            return
        for save in self._meta.saves:
            self._store(save)

    def _store(self, save: SaveSpec) -> None:
        """Gathers `save`'s chunks from the paged cache now and queues their put."""
        if not save.spans:
            return
        items = [(key, gather_chunk(self.kv_caches, slots_for(save.block_ids, self.block_size, s, e)))
                 for s, e, key in save.spans]
        nbytes = sum(kv.numel() * kv.element_size() for _, kv in items)
        ntokens = sum(e - s for s, e, _ in save.spans)
        rid = save.request_id
        done = functools.partial(self.metrics.add, rid, stored_tokens=ntokens, bytes_stored=nbytes)
        dropped = functools.partial(self.metrics.add, rid, dropped_store_bytes=nbytes)
        if not self._queue().submit(items, done, dropped):
            dropped()

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
        if self._loader is not None:
            self._loader.close(timeout=None)  # loads in flight end (and unpin) first
            self._prefetch.shutdown()
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
