"""`KVTierWorker`: the connector's worker side (docs/architecture.md, "Connector").

It does what the step's `KVTierMeta` says and nothing else:
- loads (connector/loader.py): background loads are handed to the loader thread, which
  fetches the request's chunks and scatters them into its fresh blocks while the engine keeps
  stepping, and reports their end through `get_finished`; layerwise loads are fetched layer
  by layer ahead of this step's forward, whose layer i waits only for layer i. Existence is
  not possession: a chunk evicted, corrupt or on a tier that died since the lookup stops the
  load there, and `get_block_ids_with_load_errors` names the blocks from that position on.
- saves (connector/saver.py): after the forward, the step's storable chunks that no tier
  holds are gathered once from the paged cache and queued on the store thread
  (connector/store_queue.py), so serving never waits on a tier. A finished request's tail is
  gathered the same way before the forward, and the request reported in `finished_sending`,
  so its blocks are freed.
- the extension's work (connector/extension.py; CacheBlend's blends, connector/blend/
  blender.py, when `blend.enabled`), after the loads were handed on, before the forward.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from connector.connector_config import ConnectorConfig
from connector.connector_metrics import ConnectorMetrics
from connector.extension import NoWorkerExtension, WorkerExtension, worker_extension
from connector.key_families import flush_index
from connector.loader import Loader, LoadJob
from connector.metadata import KVTierMeta, SaveSpec
from connector.presence import LocalHeldKeys, Presence
from connector.saver import Saver
from connector.store_queue import StoreQueue
from engine.kv_cache import KeyedModel, PagedKVLayout, layout_for
from engine.kv_connector import KVConnectorOutput, KVConnectorWorker
from kvkeys.keyspace import Keyspace
from kvstore.budget_check import check_tier_budgets
from kvstore.storage_manager import StorageManager

if TYPE_CHECKING:
    from engine.attention_metadata import AttentionMetadata


logger = logging.getLogger("kvtier.connector")


class KVTierWorker(KVConnectorWorker):
    """Moves K/V between the paged caches and the tiers as the scheduler side planned.

    Guarantees: loads write only the blocks a plan names, off the engine's thread, and report
    every position they did not fill; every background load is reported ended exactly once,
    cancelled ones included; stores never block a step (dropped, counted, past
    `max_pending_store_bytes`); `shutdown()` lets queued stores finish.
    """

    def __init__(self, config: ConnectorConfig, storage: StorageManager, metrics: ConnectorMetrics,
                 check_budgets: bool = True) -> None:
        self.config = config
        self.storage = storage
        self.metrics = metrics
        self._check_budgets = check_budgets
        self.stores = StoreQueue(storage, config.store_queue_size, config.max_pending_store_bytes,
                                 config.kvstore.queue_full)
        self.held_keys = LocalHeldKeys(storage, self.stores.is_pending)  # what the lookup channel serves
        self.presence = Presence([self.held_keys])
        self.model_config: KeyedModel | None = None
        self._model: torch.nn.Module | None = None
        self.layout: PagedKVLayout | None = None
        self._keyspace: Keyspace | None = None
        self.loader: Loader | None = None
        self.saver: Saver | None = None
        self.extension: WorkerExtension = NoWorkerExtension()  # the configured one, from register_layout
        self._meta: KVTierMeta | None = None
        self._step_jobs: list[LoadJob] = []  # this step's layerwise loads
        self._step_errors: set[int] = set()
        self._reported_errors: set[int] = set()
        self._failed: set[str] = set()  # background loads reported ended with unfilled blocks
        self._released: set[str] = set()  # finished requests whose tail was gathered
        self._cached: dict[str, int] = {}  # the extension's revised cached-token counts
        self._closed = False
        self._flush_deadline: float | None = None  # set by shutdown

    # ---- set-up ------------------------------------------------------------------------
    def register_model(self, model_config: KeyedModel) -> None:
        self.model_config = model_config

    def register_model_module(self, model: torch.nn.Module) -> None:
        self._model = model

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self._model_config()
        self.register_layout(layout_for(kv_caches))

    def _model_config(self) -> KeyedModel:
        if self.model_config is None:
            raise RuntimeError("register_model must be called before register_kv_caches")
        return self.model_config

    def register_layout(self, layout: PagedKVLayout, keyspace: Keyspace | None = None) -> None:
        """Takes the engine's paged caches as `layout` (kvtier's engine's, or a vLLM backend's)
        and builds the loader, saver and extension over them, keyed by `keyspace` (default: the
        model's, whole chunks); ValueError if they do not fit the model (the keyspace's heads,
        when split by head) or a connector already serves an engine."""
        mc = self._model_config()
        if self.loader is not None:
            raise ValueError("this connector already serves an engine; build one per LLM "
                             "(share tiers by passing the same StorageManager)")
        heads = mc.num_kv_heads if keyspace is None or keyspace.heads is None else keyspace.values_per_chunk
        if (layout.num_layers, layout.num_kv_heads, layout.head_size) != (mc.num_layers, heads, mc.head_size):
            raise ValueError(
                f"kv_caches ({layout.num_layers} layers, {layout.num_kv_heads} kv heads, head size "
                f"{layout.head_size}) do not match the model ({mc.num_layers} layers, "
                f"{heads} kv heads, head size {mc.head_size})")
        if self._check_budgets:  # chunk bytes are known only now
            check_tier_budgets(self.config.kvstore.tiers, layout.bytes_per_token() * self.config.chunk_size,
                               layout.dtype.itemsize)
        if keyspace is None:
            keyspace = self.config.keyspace(mc, layout.dtype)
        self._keyspace = keyspace
        self.layout = layout
        self.loader = Loader(self.storage, self.stores, layout, keyspace, self.metrics)
        self.saver = Saver(self.stores, self.presence, layout, keyspace, self.metrics)
        self.extension = worker_extension(self.config.extensions, self.storage, self.stores, layout, keyspace,
                                          self.metrics, mc, self._model)

    @property
    def keyspace(self) -> Keyspace:
        """Returns the keyspace chunks are keyed in, built once at `register_layout` (the
        planner of the same connector takes this one); RuntimeError before."""
        if self._keyspace is None:
            raise RuntimeError("the connector has no KV caches yet (register_kv_caches)")
        return self._keyspace

    def _loader(self) -> Loader:
        if self.loader is None:
            raise RuntimeError("the connector has no KV caches yet (register_kv_caches)")
        return self.loader

    # ---- the step ----------------------------------------------------------------------
    def bind_connector_metadata(self, metadata: Any) -> None:
        if not isinstance(metadata, KVTierMeta):
            raise TypeError(f"expected a KVTierMeta, got {type(metadata).__name__}")
        self._meta = metadata

    def start_load_kv(self, attn_metadata: AttentionMetadata | None) -> None:
        """Gathers finished requests' tails (their K/V is complete whatever this step does,
        and they are reported released even if its forward fails), hands the step's loads to
        the loader thread (layerwise ones run ahead of this forward), then runs the
        extension's work."""
        meta = self._meta
        if meta is None:
            return
        tails = [s for s in meta.saves if s.release]
        if tails:
            self._store(tails)
            self._released |= {s.request_id for s in tails}
        for load in meta.loads:
            job = self._loader().submit(load)
            if load.layerwise:
                self._step_jobs.append(job)
        self._cached.update(self.extension.run(meta.extension_work))

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Blocks until layer `layer_idx` of this step's layerwise loads is in place (or given up)."""
        for job in self._step_jobs:
            self._loader().wait_layer(job, layer_idx)

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata) -> None:
        """Nothing per layer: whole chunks are gathered across layers after the forward."""

    def wait_for_save(self) -> None:
        """Collects this step's layerwise loads, then gathers the step's storable chunks that
        no tier holds and queues them, skipping requests whose load failed (their step
        computed over K/V that never arrived); returns without waiting for any tier."""
        meta = self._meta
        if meta is None:
            return
        failed: set[str] = set()
        for job in self._step_jobs:
            loader = self._loader()
            loader.wait_ended(job)
            bad = loader.bad_blocks(job)
            if bad:
                self._step_errors |= bad
                failed.add(job.request_id)
        # A failed load's request is stored once recomputed; tails were stored at the start.
        self._store([s for s in meta.saves if s.request_id not in failed and not s.release])

    def _store(self, saves: list[SaveSpec]) -> None:
        if saves and self.saver is not None:
            self.saver.store(saves)

    def clear_connector_metadata(self) -> None:
        """Drops the step's metadata; a layerwise load the step left running (its forward
        failed) is cancelled and waited for, so nothing writes the blocks after the step."""
        jobs, self._step_jobs = self._step_jobs, []
        self._meta = None
        for job in jobs:
            job.cancelled = True
            self._loader().wait_ended(job)

    # ---- reports -----------------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Stops the loads of `finished_req_ids`; returns (finished requests whose tail was
        gathered, requests whose background load ended) since the last call."""
        done: dict[str, set[int]] = {}
        if self.loader is not None:
            for rid in finished_req_ids:
                self.loader.cancel(rid)
            done = self.loader.finished()
        self._reported_errors = set().union(*done.values()) if done else set()
        self._failed = {rid for rid, bad in done.items() if bad}
        sending, self._released = self._released, set()
        return sending or None, set(done) or None

    def failed_loads(self) -> set[str]:
        """Returns the requests among those the last `get_finished()` reported whose load
        left blocks unfilled."""
        return self._failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Returns the blocks the loads last reported by `get_finished()`, and this step's
        layerwise loads, did not fill."""
        errors = self._reported_errors | self._step_errors
        self._reported_errors, self._step_errors = set(), set()
        return errors

    def build_connector_output(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out = super().build_connector_output(finished_req_ids)
        out.num_cached_tokens, self._cached = self._cached, {}
        return out

    def wait_for_finished(self, timeout: float) -> None:
        """Blocks until a background load has ended (or `timeout` seconds passed); returns at
        once when a release is already there to report."""
        if not self._released and self.loader is not None:
            self.loader.wait_for_finished(timeout)

    # ---- lifecycle ---------------------------------------------------------------------
    def loads_in_flight(self) -> bool:
        """Returns True while a background load has not ended."""
        return self.loader is not None and self.loader.in_flight()

    def stores_pending(self) -> bool:
        """Returns True while a queued store (or promotion) has not reached every tier."""
        return self.stores.pending() > 0 or self.storage.writer_stats()["pending"] > 0

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until queued stores reached every tier (and the key families index its
        shared tiers); returns False on timeout."""
        ok = self.stores.flush(timeout)
        ok = flush_index(timeout) and ok
        return self.storage.flush(timeout) and ok

    def shutdown(self) -> None:
        """Lets loads in flight end (and unpin; remote loads are bounded by their deadlines),
        then writes what the store queue, the key families index and the slower tiers' writer
        hold until `flush_time_left()` runs out; what is left then is dropped and logged."""
        if self._closed:
            return
        self._closed = True
        self._flush_deadline = time.monotonic() + self.config.kvstore.flush_timeout_s
        if self.loader is not None:
            self.loader.close()
        dropped = self.stores.close(self.flush_time_left())
        if dropped:
            logger.warning("connector: the shutdown flush ran out of time (flush_timeout_s=%g): %d queued "
                           "store(s) dropped", self.config.kvstore.flush_timeout_s, dropped)
        # The index thread is a daemon: one still inside a torch call when the interpreter
        # exits aborts the process (pthread_exit unwinding through pybind11's noexcept frames).
        flush_index(self.flush_time_left())
        self.storage.flush(self.flush_time_left())

    def flush_time_left(self) -> float | None:
        """Returns the seconds the shutdown's flush has left (None before `shutdown`): the
        storage manager's owner closes it within them."""
        if self._flush_deadline is None:
            return None
        return max(0.0, self._flush_deadline - time.monotonic())
