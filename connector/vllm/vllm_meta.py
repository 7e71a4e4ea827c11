"""What crosses between kvtier's two roles inside vLLM each step (docs/vllm.md): the
scheduler role's plans (`KVTierVllmMeta`) and the worker role's report (`KVTierWorkerMeta`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from connector.kv_events import TierChangeLog, TierKey
from connector.metadata import KVTierMeta
from connector.vllm.vllm_api import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class KVTierVllmMeta(KVConnectorMetadata):
    """One step's plans, as vLLM carries connector metadata; `idle`: no tokens scheduled."""

    meta: KVTierMeta
    idle: bool = False


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    """The worker's report back to the scheduler role, sent when there is news: whether stores
    are still queued (while they are, the engine keeps stepping, so a draining shutdown waits
    for them and their counters reach /metrics) and the tiers' changes (for KV events)."""

    stores_pending: bool
    stored: list[TierKey] = field(default_factory=list)
    removed: list[TierKey] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Returns self with `other` (another worker's report of the same step) added."""
        if isinstance(other, KVTierWorkerMeta):
            self.stores_pending = self.stores_pending or other.stores_pending
            self.stored += other.stored
            self.removed += other.removed
        return self


class WorkerReports:
    """The worker role's report after each step (`report`), sent only when there is news."""

    def __init__(self, changes: TierChangeLog | None) -> None:
        self.changes = changes  # the tiers' changes, for KV events (None: events are off)
        self._pending = False  # what the last report said

    def report(self, stores_pending: bool) -> KVTierWorkerMeta | None:
        """Returns this step's report: stores pending (every step while they are, and once when
        they no longer are) and the tiers' changes; None when there is no news."""
        stored, removed = self.changes.drain() if self.changes is not None else ([], [])
        # vLLM merges one step's reports of all ranks, starting from the first that is not None:
        # a rank still storing must say so every step, or another rank's "done" would stand
        # alone and the engine would stop stepping before this rank's stores (and figures) land.
        if not stores_pending and not self._pending and not stored and not removed:
            return None
        self._pending = stores_pending
        return KVTierWorkerMeta(stores_pending, stored, removed)
