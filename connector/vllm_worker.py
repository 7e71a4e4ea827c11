"""vLLM's worker role, in kvtier's terms: `KVTierWorker` over vLLM's paged caches
(connector/vllm.py dispatches here; docs/vllm.md).

vLLM names its per-layer caches (`model.layers.3.self_attn.attn`) and lays them out per
attention backend; this module orders them by layer, wraps them in that backend's
`PagedKVLayout` (connector/vllm_layouts.py) and forwards each hook by layer index. It also
answers the scheduler process's existence questions (connector/lookup_channel.py): the
worker's tiers and pending stores live here. It never imports vllm.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from connector.config import ConnectorConfig
from connector.kv_events import TierChangeLog, TierKey
from connector.lookup_channel import LookupServer, lookup_socket_path
from connector.metadata import KVTierMeta
from connector.metrics import ConnectorMetrics, RequestKVMetrics
from connector.vllm_layouts import vllm_layout_for
from connector.worker import KVTierWorker
from engine.model_config import ModelConfig
from kvstore.storage_manager import StorageManager

_LAYER_INDEX = re.compile(r"\.(\d+)\.")

COUNTERS = ("connector_hit_tokens", "load_error_tokens", "bytes_loaded", "load_seconds",
            "stored_tokens", "bytes_stored", "dropped_store_bytes")
"""The totals the worker reports to vLLM each step (as deltas; connector/vllm.py's stats)."""

IDLE_WAIT = 0.05
"""Seconds an idle step waits for a load in flight, or queued stores, before reporting (the
engine steps again at once; a request arriving meanwhile waits at most this long)."""


@dataclass
class WorkerReport:
    """What the worker tells the scheduler side after a step (connector/vllm.py carries it
    as vLLM's worker metadata): stores still queued, and the tiers' changes (for KV events)."""

    stores_pending: bool
    stored: list[TierKey] = field(default_factory=list)
    removed: list[TierKey] = field(default_factory=list)

    def merge(self, other: WorkerReport) -> WorkerReport:
        """Returns self with `other` (another worker's report of the same step) added."""
        self.stores_pending = self.stores_pending or other.stores_pending
        self.stored += other.stored
        self.removed += other.removed
        return self


def layer_index(name: str) -> int:
    """Returns the layer number in a vLLM attention layer name; ValueError if it has none or several."""
    found = _LAYER_INDEX.findall(f".{name}.")
    if len(found) != 1:
        raise ValueError(f"cannot tell the layer number of KV cache {name!r}")
    return int(found[0])


class VllmWorkerSide:
    """`KVTierWorker` behind vLLM's worker-role hooks, over tiers opened in this process.

    Guarantees: the lookup channel answers from this worker's `Presence` (pending stores
    included) from construction until `shutdown()`; `shutdown()` lets queued stores finish
    and closes the tiers, once.
    """

    def __init__(self, config: ConnectorConfig, model_config: ModelConfig, instance_id: str, backend: str,
                 events: bool = False) -> None:
        self.backend = backend
        self.storage = StorageManager.from_config(config.kvstore)
        # events: what the tiers stored and removed, reported to the scheduler side each step
        self.changes: TierChangeLog | None = TierChangeLog() if events else None
        if self.changes is not None:
            self.storage.set_listener(self.changes)
        self.metrics = ConnectorMetrics()
        self.worker = KVTierWorker(config, self.storage, self.metrics)
        self.worker.register_model(model_config)
        self._layers: dict[str, int] = {}
        self._reported = RequestKVMetrics("*")
        self._server = LookupServer(self.worker.presence, lookup_socket_path(instance_id))
        self._idle = False
        self._reported_pending = False
        self._closed = False

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Takes vLLM's named per-layer caches (one KV cache group, layers 0..L-1)."""
        names = sorted(kv_caches, key=layer_index)
        indices = [layer_index(n) for n in names]
        if indices != list(range(len(names))):
            raise ValueError(f"KV caches must be layers 0..{len(names) - 1}, got {indices}")
        self._layers = {n: i for i, n in enumerate(names)}
        self.worker.register_layout(vllm_layout_for([kv_caches[n] for n in names], self.backend))

    # ---- the step ----------------------------------------------------------------------
    def bind(self, meta: KVTierMeta, idle: bool) -> None:
        """Takes the step's plans (before the forward, whichever hook runs first); `idle`: the
        step schedules no tokens (vLLM steps only for the connector)."""
        self.worker.bind_connector_metadata(meta)
        self._idle = idle

    def start_load_kv(self) -> None:
        """Starts the step's loads (layerwise ones ahead of the forward) and gathers finished
        requests' tails."""
        self.worker.start_load_kv(None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(self._layers[layer_name])

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def report(self) -> WorkerReport | None:
        """Returns what the scheduler side must hear after this step: whether stores are
        pending (when that changed) and the tiers' changes since the last report; None when
        there is nothing new."""
        pending = self.worker.stores_pending()
        stored, removed = self.changes.drain() if self.changes is not None else ([], [])
        if pending == self._reported_pending and not stored and not removed:
            return None
        self._reported_pending = pending
        return WorkerReport(pending, stored, removed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Returns (requests whose tail was gathered, requests whose load ended) since the last
        call. On an idle step (vLLM steps only for the connector) it first waits, up to
        IDLE_WAIT seconds, for a load in flight to end, else for queued stores to land: the
        engine neither spins hot nor reports a finished load one poll late."""
        if self._idle:
            if self.worker.loads_in_flight():
                self.worker.wait_for_finished(IDLE_WAIT)
            elif self.worker.stores_pending():
                self.worker.flush(IDLE_WAIT)
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def clear(self) -> None:
        self.worker.clear_connector_metadata()

    def stats_delta(self) -> dict[str, float]:
        """Returns what moved since the last call: the COUNTERS, and tokens loaded per tier
        as `loaded_tokens.<tier>`; empty when nothing did."""
        now = self.metrics.totals_now()
        before, self._reported = self._reported, now
        out: dict[str, float] = {}
        for f in fields(RequestKVMetrics):
            if f.name in COUNTERS:
                d = getattr(now, f.name) - getattr(before, f.name)
                if d:
                    out[f.name] = d
        for tier, n in now.loaded_tokens_by_tier.items():
            d = n - before.loaded_tokens_by_tier.get(tier, 0)
            if d:
                out[f"loaded_tokens.{tier}"] = d
        return out

    def shutdown(self) -> None:
        """Stops the lookup channel, lets queued stores finish, closes the tiers."""
        if self._closed:
            return
        self._closed = True
        self._server.close()
        try:
            self.worker.shutdown()
        finally:
            self.storage.close(self.worker.flush_time_left())  # within the worker's flush bound

    def info(self) -> dict[str, Any]:
        """Returns the backend and layer count (for logs)."""
        layout = self.worker.layout
        return {"backend": self.backend, "layers": len(self._layers),
                "bytes_per_token": layout.bytes_per_token() if layout is not None else 0}
