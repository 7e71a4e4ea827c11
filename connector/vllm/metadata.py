"""What crosses between kvtier's two roles inside vLLM each step (docs/vllm.md): the
scheduler role's plans (`KVTierVllmMeta`) and the worker role's report (`KVTierWorkerMeta`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from connector.kv_events import TierKey
from connector.metadata import KVTierMeta
from connector.vllm.api import KVConnectorMetadata, KVConnectorWorkerMetadata


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
