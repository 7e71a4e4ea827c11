"""The router's own Prometheus metrics (`kvtier:router_*`), in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

_LOOKUP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class RouterMetrics:
    """Routing decisions, lookup latency, backend errors and health, per backend URL."""

    def __init__(self) -> None:
        disable_created_metrics()
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvtier:router_requests", "Requests sent to a backend (each try counts).",
                                ["backend", "role"], registry=r)
        self.hit_tokens = Counter("kvtier:router_routed_hit_tokens",
                                  "Prompt tokens the chosen backend reported holding (kv-aware).",
                                  ["backend"], registry=r)
        self.backend_errors = Counter("kvtier:router_backend_errors",
                                      "Failed calls to a backend, by kind (connect, timeout, status, stream, lookup).",
                                      ["backend", "kind"], registry=r)
        self.lookup_seconds = Histogram("kvtier:router_lookup_seconds",
                                        "One kv-aware lookup round over all candidates.",
                                        buckets=_LOOKUP_BUCKETS, registry=r)
        self.healthy = Gauge("kvtier:router_backend_healthy", "1 while the backend is in rotation.",
                             ["backend"], registry=r)
        self.in_flight = Gauge("kvtier:router_backend_in_flight", "Requests open on the backend.",
                               ["backend"], registry=r)
        self.prefill_fallbacks = Counter("kvtier:router_prefill_fallbacks",
                                         "Disaggregated requests whose prefill backend failed (decode prefilled).",
                                         registry=r)
        self.no_backend = Counter("kvtier:router_no_backend", "Requests refused: no healthy backend (503).",
                                  registry=r)
