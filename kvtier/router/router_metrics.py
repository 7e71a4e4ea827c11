"""The router's own Prometheus metrics (`kvtier:router_*`, rows of connector/metric_table.py), in a
registry of its own."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from connector.metric_table import METRICS

_LOOKUP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_KINDS: dict[str, Any] = {"counter": Counter, "gauge": Gauge}


class RouterMetrics:
    """Routing decisions, lookup latency, backend errors and health, per backend URL."""

    def __init__(self) -> None:
        disable_created_metrics()
        self.registry = r = CollectorRegistry()

        def make(short: str) -> Any:
            m = METRICS[short]
            return _KINDS[m.kind](m.name, m.doc, list(m.labels), registry=r)

        self.requests = make("router_requests")
        self.hit_tokens = make("router_routed_hit_tokens")
        self.backend_errors = make("router_backend_errors")
        lookup = METRICS["router_lookup_seconds"]
        self.lookup_seconds = Histogram(lookup.name, lookup.doc, buckets=_LOOKUP_BUCKETS, registry=r)
        self.healthy = make("router_backend_healthy")
        self.in_flight = make("router_backend_in_flight")
        self.prefill_fallbacks = make("router_prefill_fallbacks")
        self.no_backend = make("router_no_backend")
