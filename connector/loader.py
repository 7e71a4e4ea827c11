"""The connector's loader thread: fetches a request's stored chunks and scatters them into its
fresh blocks, off the engine's thread (docs/architecture.md, "Connector").

Two kinds of load, both stopping at the first chunk that is missing or malformed (existence
at lookup is not possession); `LoadJob.filled` ends the positions every layer got:
- whole chunks (asynchronous loads, the request parked meanwhile): FETCH_GROUP chunks per
  fetch, the next FETCH_AHEAD groups fetched on prefetch threads while this one is
  scattered; the end is reported by `finished()` with the blocks not filled. When the
  fastest tier reads in place (the disk tier, raw values, blocks in host memory), a fetch
  reads its chunks straight into the blocks: there is nothing left to scatter.
- layer by layer (`use_layerwise`, the request runs in the step that admitted it): layer i of
  every chunk (one stored value each, kvkeys/keyspace.py) is fetched and scattered in
  layer order, the next layer fetched while this one is scattered; the forward's layer i
  waits only for it (`wait_layer`). The step reports what did not arrive.
Split by KV head (vLLM's connector, kvkeys/keyspace.py), a chunk's values are fetched in one
batch and handed to the layout's `scatter_heads`, which writes each where its heads go (vLLM's
CPU pages: no joined copy of the chunk first).
Hits from slower tiers are queued for promotion through the store queue once the load ended;
the load never waits for that write. On CUDA the scatter runs on a side stream from pinned
host memory (connector/load_staging.py).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from connector.connector_metrics import ConnectorMetrics
from connector.load_staging import to_device_source
from connector.metadata import LoadSpec
from connector.store_queue import StoreQueue
from engine.kv_cache import PagedKVLayout
from kvkeys.keyspace import Keyspace, Span, layer_key
from kvstore.backend import Destination
from kvstore.background_queue import BACKGROUND_NICE, BackgroundQueue, lower_thread_priority
from kvstore.storage_manager import StorageManager

# Background loads queued at most; one past it is refused and computed instead.
LOAD_QUEUE_SIZE = 4096
# Chunks per fetch of a whole-chunk load.
FETCH_GROUP = 2
# Groups fetched while one is scattered, one per fetch thread: fetching is CPU work too
# (receiving, checksums and MACs, lz4, reads in place), and two threads fetch lz4 and Redis
# chunks markedly faster than one (benchmarks/bench_load.py measures it).
FETCH_AHEAD = 2
logger = logging.getLogger("kvtier.connector")
Fetched = list[tuple[torch.Tensor | None, int]]
FetchedChunk = tuple["torch.Tensor | list[torch.Tensor] | Destination | None", int]
"""One chunk fetched, with its tier: the value, its values per KV head, what was read in place, or None."""


@dataclass
class LoadJob(LoadSpec):
    """One load being run: its plan (`LoadSpec`'s fields) and how far it got."""

    cancelled: bool = False  # the request finished (or its step failed): stop writing its blocks
    # CUDA: recorded on the engine's stream at admission; the load stream waits for it, so
    # kernels still using these blocks for their previous owner finish before they are written.
    ready: Any = None
    filled: int = -1  # once ended: positions [start, filled) arrived in every layer
    layers_done: int = 0  # layerwise: layers [0, layers_done) are in place (or given up)
    layer_events: list[Any] = field(default_factory=list)  # CUDA: one per layer, on the load stream
    ended: bool = False
    tiers: list[int] = field(default_factory=list)  # per span: the tier it (its layer 0) came from
    # Where moves stop: `end`, or past it to the end of its block where the layout moves whole
    # blocks (the rest of that block is positions the engine computes after the load anyway).
    move_end: int = -1

    def bounds(self, sp: Span) -> tuple[int, int]:
        """Returns the positions [lo, hi) of span `sp` that this job writes (to `move_end`)."""
        return max(sp.start, self.start), min(sp.end, self.move_end)


def chunk_ok(kv: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether a fetched value is a tensor of exactly `shape` and `dtype` (the caches')."""
    return isinstance(kv, torch.Tensor) and kv.dtype == dtype and tuple(kv.shape) == shape


def head_pieces(pieces: Sequence[tuple[torch.Tensor | Destination | None, int]],
                shape: tuple[int, ...], dtype: torch.dtype) -> tuple[list[torch.Tensor] | None, int]:
    """Returns one chunk's fetched per-head values, in head order, with the slowest tier any
    came from; (None, -1) unless every piece is a tensor of `shape` and `dtype`."""
    if not all(isinstance(kv, torch.Tensor) and chunk_ok(kv, shape, dtype) for kv, _ in pieces):
        return None, -1
    return [kv for kv, _ in pieces], max(tier for _, tier in pieces)  # type: ignore[misc]


class Loader:
    """Runs loads on one thread, in submission order. Guarantees: every submitted job ends
    exactly once (released, `filled` set); a cancelled job writes no further chunk."""

    def __init__(self, storage: StorageManager, stores: StoreQueue, layout: PagedKVLayout, keyspace: Keyspace,
                 metrics: ConnectorMetrics) -> None:
        self.storage = storage
        self.stores = stores
        self.layout = layout
        self.keyspace = keyspace
        self.metrics = metrics
        self.num_layers = layout.num_layers
        # A full queue refuses a job; that load is reported failed (recomputed).
        self.jobs = BackgroundQueue(LOAD_QUEUE_SIZE, "drop_new", "kvtier-connector-load", nice=BACKGROUND_NICE)
        self._prefetch = ThreadPoolExecutor(FETCH_AHEAD, thread_name_prefix="kvtier-connector-fetch",
                                            initializer=lower_thread_priority, initargs=(BACKGROUND_NICE,))
        # The fastest tier reads chunks straight into the blocks: nothing left to scatter.
        self._in_place = storage.reads_in_place and layout.writes_in_place and keyspace.values_per_chunk == 1
        device = layout.device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._cond = threading.Condition()
        self._loading: dict[str, LoadJob] = {}
        self._done: dict[str, set[int]] = {}  # ended whole-chunk (or cancelled) loads, unreported

    def _held_keys(self, job: LoadJob) -> list[str]:
        return self.keyspace.stored_keys(job.spans)

    def _shape(self, layers: int, num_tokens: int, heads: int | None = None) -> tuple[int, ...]:
        return (layers, 2, num_tokens, self.layout.num_kv_heads if heads is None else heads, self.layout.head_size)

    def submit(self, spec: LoadSpec) -> LoadJob:
        """Holds the load's stored values (no tier evicts them) and queues it (refused: it ends at once, nothing
        filled); returns the running job."""
        if spec.layerwise != self.keyspace.layerwise:
            raise ValueError("a layerwise load needs a layerwise keyspace (use_layerwise) and the reverse")
        job = LoadJob(**{f.name: getattr(spec, f.name) for f in fields(LoadSpec)})
        step = self.layout.tokens_per_move
        job.move_end = min(-(-job.end // step) * step, job.spans[-1].end) if job.spans else job.end
        self.storage.hold(self._held_keys(job))  # no tier evicts them before they are read
        if self._stream is not None:
            job.ready = torch.cuda.Event()
            job.ready.record()
        with self._cond:
            self._loading[job.request_id] = job
        if not self.jobs.submit(functools.partial(self._run, job)):
            self._end(job, job.start)
        return job

    def finished(self) -> dict[str, set[int]]:
        """Returns the whole-chunk (and cancelled) loads ended since the last call, each with
        the blocks it did not fill."""
        with self._cond:
            done, self._done = self._done, {}
        return done

    def in_flight(self) -> bool:
        """Returns True while a submitted load has not ended."""
        with self._cond:
            return bool(self._loading)

    def wait_for_finished(self, timeout: float) -> None:
        """Blocks until `finished()` has something (or `timeout` seconds passed)."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._done), timeout)

    def cancel(self, request_id: str) -> None:
        """Stops the request's load, if one is in flight, at its next chunk; `finished()`
        still reports it, once it let go of the blocks."""
        with self._cond:
            job = self._loading.get(request_id)
            if job is not None:
                job.cancelled = True

    def wait_layer(self, job: LoadJob, layer: int) -> None:
        """Blocks until layer `layer` of `job` is in place (or given up); on CUDA the current
        stream then waits for its copies."""
        with self._cond:
            self._cond.wait_for(lambda: job.layers_done > layer or job.ended)
            event = job.layer_events[layer] if layer < len(job.layer_events) else None
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def wait_ended(self, job: LoadJob) -> None:
        """Blocks until `job` ended (its `filled` is final)."""
        with self._cond:
            self._cond.wait_for(lambda: job.ended)

    def bad_blocks(self, job: LoadJob) -> set[int]:
        """Returns the blocks of an ended `job` from its first unfilled position to its end."""
        if job.cancelled or job.filled >= job.end:
            return set()
        bs = self.layout.block_size
        return {b for table in job.block_ids for b in table[job.filled // bs: -(-job.end // bs)]}

    # ---- loader thread -------------------------------------------------------------------
    def _run(self, job: LoadJob) -> None:
        filled = job.start
        job.tiers = [-1] * len(job.spans)
        t0 = time.perf_counter()
        nbytes = [0]
        promote: list[tuple[str, torch.Tensor, int]] = []
        try:
            if not job.cancelled:
                self.stores.wait_for(self._held_keys(job))  # read-your-writes, on this thread
                stream = self._stream
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    if stream is not None and job.ready is not None:
                        stream.wait_event(job.ready)
                    load = self._load_layers if job.layerwise else self._load_chunks
                    filled = load(job, nbytes, promote)
                    if stream is not None:
                        stream.synchronize()  # in place before the engine may read the blocks
        except Exception:  # a failed load is a recompute, never a crash of the loader
            logger.exception("loading request %s failed", job.request_id)
        finally:
            self.metrics.add(job.request_id, bytes_loaded=nbytes[0], load_seconds=time.perf_counter() - t0)
            self._end(job, filled)
            if promote:
                self.stores.promote(promote)  # refused when the queue is full: promoted by a later load

    def _load_chunks(self, job: LoadJob, nbytes: list[int], promote: list[tuple[str, torch.Tensor, int]]) -> int:
        """Scatters whole chunks in order (chunks read in place are there already); returns
        the end of what arrived."""
        filled = job.start
        keep: list[torch.Tensor] = []  # pinned sources stay alive until the stream is synchronised
        layout = self.layout
        slots = layout.group_slots(job.block_ids, job.start, job.move_end)  # once: per chunk was a visible share
        with contextlib.closing(self._fetch_groups(job, slots)) as fetched:
            for i, (sp, (kv, tier)) in enumerate(fetched):
                if job.cancelled or kv is None:
                    break  # evicted or corrupt: computed from here on
                lo, hi = job.bounds(sp)
                at = slots[..., lo - job.start:hi - job.start]
                if isinstance(kv, list):  # a value per KV head, checked by head_pieces
                    layout.scatter_heads(at, [to_device_source(p[:, :, lo - sp.start:hi - sp.start], layout.device,
                                                               keep) for p in kv])
                    if tier > 0:
                        promote += [(key, p, tier) for key, p in zip(self.keyspace.stored_keys([sp]), kv)]
                elif isinstance(kv, torch.Tensor):
                    if not chunk_ok(kv, self._shape(self.num_layers, sp.num_tokens), layout.dtype):
                        break  # foreign
                    layout.scatter_chunk(at, to_device_source(kv[:, :, lo - sp.start:hi - sp.start], layout.device,
                                                              keep))
                    if tier > 0:
                        promote += [(key, value, tier) for key, value in self.keyspace.chunk_values(sp.key, kv)]
                nbytes[0] += sum(p.nbytes for p in kv) if isinstance(kv, list) else kv.nbytes
                filled = min(hi, job.end)
                job.tiers[i] = tier
        return filled

    def _fetch_groups(self, job: LoadJob, slots: torch.Tensor
                      ) -> Generator[tuple[Span, FetchedChunk]]:
        """Yields each span of `job` with its fetched (value, tier), in order, FETCH_GROUP per
        fetch, the next FETCH_AHEAD groups fetched while the caller scatters this one; stops
        fetching once the job is cancelled or a group comes back short. Closed, it returns
        once no fetch is running: nothing writes the job's blocks after it."""
        groups = [job.spans[i:i + FETCH_GROUP] for i in range(0, len(job.spans), FETCH_GROUP)]
        pending = collections.deque(self._prefetch.submit(self._fetch_group, job, group, slots)
                                    for group in groups[:FETCH_AHEAD])
        try:
            for g, group in enumerate(groups):
                values = pending.popleft().result()
                stop = job.cancelled or any(v is None for v, _ in values)
                if not stop and g + FETCH_AHEAD < len(groups):
                    pending.append(self._prefetch.submit(self._fetch_group, job, groups[g + FETCH_AHEAD], slots))
                yield from zip(group, values)
                if stop:
                    return
        finally:
            for f in pending:
                f.exception()  # waits; a fetch that failed is only a miss

    def _fetch_group(self, job: LoadJob, group: list[Span], slots: torch.Tensor) -> Sequence[FetchedChunk]:
        """Returns the fetched (value, tier) of each span of `group` (see `StorageManager.fetch`);
        `slots` are the job's, positions [start, end)."""
        if not self._in_place:  # only scattered
            ks = self.keyspace
            values = self.storage.fetch(ks.stored_keys(group), read_only=True, held=True)
            n = ks.values_per_chunk
            if n == 1:
                return values
            return [head_pieces(values[i:i + n], self._shape(self.num_layers, sp.num_tokens, heads=1),
                                self.layout.dtype)
                    for i, sp in zip(range(0, len(values), n), group)]
        keys = [sp.key for sp in group]
        into = []
        for sp in group:
            lo, hi = job.bounds(sp)
            views = self.layout.chunk_views(slots[..., lo - job.start:hi - job.start], lo - sp.start, sp.end - hi)
            into.append(Destination(self._shape(self.num_layers, sp.num_tokens), self.layout.dtype, views))
        return self.storage.fetch(keys, read_only=True, into=into, held=True)

    def _load_layers(self, job: LoadJob, nbytes: list[int], promote: list[tuple[str, torch.Tensor, int]]) -> int:
        """Scatters layer by layer, marking each layer done; returns the end of what arrived
        in every layer. A layer whose chunk c fails cuts `filled` to c's start for the layers
        after it too (the positions before it must be complete in every layer)."""
        filled = job.move_end  # cut to job.end when returned
        layout = self.layout
        # Host-side slots: scatter_layer checks them without a device sync, then moves them.
        job_slots = layout.group_slots(job.block_ids, job.start, job.move_end)
        slots = [job_slots[..., lo - job.start:hi - job.start] for lo, hi in map(job.bounds, job.spans)]
        keep: list[torch.Tensor] = []

        def fetch(layer: int, upto: int) -> Future[tuple[list[int], Fetched]]:
            wanted = [i for i, sp in enumerate(job.spans) if sp.start < upto]
            keys = [layer_key(job.spans[i].key, layer) for i in wanted]
            return self._prefetch.submit(lambda: (wanted, self.storage.fetch(keys, read_only=True, held=True)))

        pending = fetch(0, filled)
        for layer in range(self.num_layers):
            wanted, values = pending.result()
            if layer + 1 < self.num_layers:
                pending = fetch(layer + 1, filled)  # while this layer is scattered
            for i, (kv, tier) in zip(wanted, values):
                sp = job.spans[i]
                if sp.start >= filled:
                    break
                if job.cancelled or kv is None or not chunk_ok(kv, self._shape(1, sp.num_tokens), layout.dtype):
                    filled = max(job.start, sp.start)
                    break
                lo, hi = max(sp.start, job.start), min(sp.end, filled)
                src = to_device_source(kv[0, :, lo - sp.start:hi - sp.start], layout.device, keep)
                layout.scatter_layer(layer, slots[i][..., :hi - lo], src)
                nbytes[0] += kv.numel() * kv.element_size()
                if layer == 0:
                    job.tiers[i] = tier
                if tier > 0:
                    promote.append((layer_key(sp.key, layer), kv, tier))
            self._layer_done(job, layer)
        return min(filled, job.end)

    def _layer_done(self, job: LoadJob, layer: int) -> None:
        event = None
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record(self._stream)
        with self._cond:
            job.layer_events.append(event)
            job.layers_done = layer + 1
            self._cond.notify_all()

    def _end(self, job: LoadJob, filled: int) -> None:
        """Releases the job's values, records `filled` and queues a whole-chunk (or cancelled)
        job's report."""
        self.storage.release(self._held_keys(job))
        job.filled = filled
        rid = job.request_id
        if not job.cancelled:
            by_tier: dict[str, int] = {}
            for sp, tier in zip(job.spans, job.tiers):  # the tokens of [start, filled) each gave
                n = min(sp.end, filled) - max(sp.start, job.start)
                if n > 0 and tier >= 0:
                    name = self.storage.names[tier]
                    by_tier[name] = by_tier.get(name, 0) + n
            self.metrics.add(rid, by_tier, connector_hit_tokens=filled - job.start, load_error_tokens=job.end - filled)
        with self._cond:
            job.ended = True
            if self._loading.get(rid) is job:
                del self._loading[rid]
                if not job.layerwise or job.cancelled:
                    self._done[rid] = self.bad_blocks(job)
            self._cond.notify_all()

    def close(self) -> None:
        """Lets queued loads end (and release their holds), then stops the threads."""
        self.jobs.close(timeout=None)
        self._prefetch.shutdown()
