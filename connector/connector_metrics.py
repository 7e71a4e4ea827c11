"""What the connector did, per request and per tier (tokens hit, bytes moved, load time)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from connector.metric_table import METRICS, Metric
from kvstore.tier_stats import TierStats

PROM_COUNTERS: dict[str, Metric] = {field: METRICS[f"kv_{name}"] for field, name in (
    ("connector_hit_tokens", "connector_hit_tokens"), ("load_error_tokens", "load_error_tokens"),
    ("bytes_loaded", "loaded_bytes"), ("load_seconds", "load_seconds"), ("stored_tokens", "stored_tokens"),
    ("bytes_stored", "stored_bytes"), ("dropped_store_bytes", "dropped_store_bytes"))}
"""The connector's totals on /metrics, the same on `kvtier serve` and `vllm serve`:
`RequestKVMetrics` field -> its row of the metric table (connector/metric_table.py)."""

TIER_HIT_TOKENS = METRICS["kv_tier_hit_tokens"]
"""The per-tier counter (label `tier`) of prompt tokens loaded, on both servers: `loaded_tokens_by_tier`."""


@dataclass
class RequestKVMetrics:
    """One request's traffic through the connector (tokens are prompt positions)."""

    request_id: str
    num_prompt_tokens: int = 0
    engine_hit_tokens: int = 0  # held by the engine's own prefix cache at admission
    # Loaded from a tier instead of computed (CacheBlend: the segments fetched; segments it
    # computes, cold or promised exact, are not counted, and neither is their compute time).
    connector_hit_tokens: int = 0
    # Of those, per tier that served them (tier names as in `tier_metrics`), where the load
    # path reports it (CacheBlend's segment fetches do).
    loaded_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    load_error_tokens: int = 0  # promised at lookup, not loaded (gone or bad at fetch): computed
    bytes_loaded: int = 0
    load_seconds: float = 0.0  # fetch from the tiers + scatter into the paged cache (CacheBlend: + re-rotation)
    stored_tokens: int = 0  # tokens of chunks put into the tiers (counted once the put ran)
    bytes_stored: int = 0
    dropped_store_bytes: int = 0  # over the pending-store budget: not stored, not waited for
    tenant: str | None = None  # the tag of the request's cache_salt (kvkeys/tenants.py); None: unsalted

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TierKVMetrics:
    """One tier's totals as the storage manager saw them, and `tokens_hit`: the prompt tokens
    the connector loaded from it (`RequestKVMetrics.loaded_tokens_by_tier`, as on vllm serve)."""

    name: str
    healthy: bool
    chunks_hit: int
    tokens_hit: int
    bytes_loaded: int
    bytes_stored: int
    load_seconds: float
    errors: int
    dropped_writes: int
    timeouts: int = 0  # remote calls that failed or ended past their deadline
    skipped: int = 0  # calls not made: the tier's breaker was open
    breaker_opens: int = 0
    read_breaker: int = 0  # kvstore.health.BreakerState: 0 closed, 1 open, 2 half-open
    write_breaker: int = 0

    @classmethod
    def from_stats(cls, s: TierStats, tokens_hit: int) -> TierKVMetrics:
        """Returns the metrics for one tier's stats and the prompt tokens loaded from it."""
        return cls(name=s.name, healthy=s.healthy, chunks_hit=s.hits, tokens_hit=tokens_hit,
                   bytes_loaded=s.bytes_loaded, bytes_stored=s.bytes_stored,
                   load_seconds=s.load_seconds, errors=s.errors, dropped_writes=s.dropped_writes,
                   timeouts=s.timeouts, skipped=s.skipped, breaker_opens=s.breaker_opens,
                   read_breaker=s.read_breaker, write_breaker=s.write_breaker)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


UNSALTED_LABEL = "none"
OTHER_TENANTS_LABEL = "other"
TENANT_FIGURES = ("connector_hit_tokens", "bytes_loaded", "load_seconds", "stored_tokens", "bytes_stored")
"""The running totals kept per tenant label (hits, loads and stores)."""


class ConnectorMetrics:
    """Per-request records (live ones plus the last `keep` finished) and running totals, also
    per tenant label: a configured tenant's name (`tenant_names`, tag -> name), "other" for
    any other salt, "none" for unsalted requests, so the labels stay a bounded set.

    Thread-safe: the store thread adds stored bytes while the engine thread reads.
    """

    def __init__(self, keep: int = 1024) -> None:
        self.keep = keep
        self._live: dict[str, RequestKVMetrics] = {}
        self._done: OrderedDict[str, RequestKVMetrics] = OrderedDict()
        self._lock = threading.Lock()
        self.totals = RequestKVMetrics(request_id="*")
        self.tenant_names: dict[str, str] = {}
        self._by_tenant: dict[str, dict[str, float]] = {}

    def tenant_label(self, tag: str | None) -> str:
        """Returns the label of tenant `tag`: its configured name, "other", or "none" (unsalted)."""
        if tag is None:
            return UNSALTED_LABEL
        return self.tenant_names.get(tag, OTHER_TENANTS_LABEL)

    def set_tenant(self, request_id: str, tag: str | None) -> None:
        """Records the tenant tag of a request in flight (its later figures count for it)."""
        self.live(request_id).tenant = tag

    def tenant_totals(self) -> dict[str, dict[str, float]]:
        """Returns label -> TENANT_FIGURES totals; every configured name, "other" and "none"
        are present (zeros until they move)."""
        with self._lock:
            labels = [*self.tenant_names.values(), OTHER_TENANTS_LABEL, UNSALTED_LABEL]
            zero = dict.fromkeys(TENANT_FIGURES, 0.0)
            return {label: {**zero, **self._by_tenant.get(label, {})} for label in labels}

    def live(self, request_id: str) -> RequestKVMetrics:
        """Returns the record of a request in flight, creating it on first use."""
        with self._lock:
            m = self._live.get(request_id)
            if m is None:
                m = self._live[request_id] = RequestKVMetrics(request_id)
            return m

    def add(self, request_id: str, loaded_by_tier: Mapping[str, int] | None = None, **deltas: float) -> None:
        """Adds `deltas` to the request's counters and `loaded_by_tier` to its tokens loaded
        per tier, and both to the totals."""
        with self._lock:
            m = self._live.get(request_id) or self._done.get(request_id)
            if m is None:  # first sight, or aged out: a bounded finished record either way
                m = self._done[request_id] = RequestKVMetrics(request_id)
                while len(self._done) > self.keep:
                    self._done.popitem(last=False)
            per_tenant = self._by_tenant.setdefault(self.tenant_label(m.tenant), {})
            for name, value in deltas.items():
                setattr(m, name, getattr(m, name) + value)
                setattr(self.totals, name, getattr(self.totals, name) + value)
                if name in TENANT_FIGURES:
                    per_tenant[name] = per_tenant.get(name, 0) + value
            for tier, n in (loaded_by_tier or {}).items():
                for rec in (m, self.totals):
                    rec.loaded_tokens_by_tier[tier] = rec.loaded_tokens_by_tier.get(tier, 0) + n

    def finish(self, request_id: str) -> None:
        """Moves a request's record to the finished list (oldest dropped beyond `keep`)."""
        with self._lock:
            m = self._live.pop(request_id, None)
            if m is None:
                return
            self._done[request_id] = m
            while len(self._done) > self.keep:
                self._done.popitem(last=False)

    def totals_now(self) -> RequestKVMetrics:
        """Returns a copy of the running totals (consistent: taken under the lock)."""
        with self._lock:
            return RequestKVMetrics(**asdict(self.totals))

    def request(self, request_id: str) -> RequestKVMetrics | None:
        """Returns a copy of a request's record (live or recently finished), or None."""
        with self._lock:
            m = self._live.get(request_id) or self._done.get(request_id)
            return None if m is None else RequestKVMetrics(**asdict(m))
