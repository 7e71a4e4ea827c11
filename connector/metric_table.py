"""Every `kvtier:*` Prometheus metric, declared once: its name, kind, labels and meaning, the same
on `kvtier serve`, `vllm serve` with kvtier's connector and `kvtier router` (docs/serving.md,
"Metrics"). A server exposes the rows it can compute and no other: a figure one deployment
cannot compute is absent there, never a different figure under the same name.
tests/test_metric_table.py holds every `kvtier:` name in the shipped code to this table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Metric:
    """One metric: `name` as exposed (a counter gets `_total`), its kind, labels and meaning.
    `on`: the servers that expose it (`serve`: kvtier serve, `vllm`: vllm serve with kvtier's
    connector, `router`: kvtier router)."""

    name: str
    kind: Literal["counter", "gauge", "histogram"]
    doc: str
    labels: tuple[str, ...] = ()
    on: frozenset[str] = frozenset({"serve"})


_BOTH = frozenset({"serve", "vllm"})
_ROUTER = frozenset({"router"})


def _rows(*metrics: Metric) -> dict[str, Metric]:
    return {m.name.removeprefix("kvtier:"): m for m in metrics}


METRICS: dict[str, Metric] = _rows(
    # the engine of kvtier serve (vllm serve has its own `vllm:*` for these)
    Metric("kvtier:num_requests_running", "gauge", "Requests in the running batch."),
    Metric("kvtier:num_requests_waiting", "gauge", "Requests waiting to be scheduled."),
    Metric("kvtier:kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (1 = full)."),
    Metric("kvtier:time_to_first_token_seconds", "histogram", "Arrival to first token."),
    Metric("kvtier:inter_token_latency_seconds", "histogram", "Time between a request's tokens."),
    Metric("kvtier:e2e_request_latency_seconds", "histogram", "Arrival to finish."),
    Metric("kvtier:prompt_tokens", "counter",
           "Prompt tokens of requests that produced output (a token, or a scored prompt)."),
    Metric("kvtier:generation_tokens", "counter", "Generated tokens."),
    Metric("kvtier:prefix_cache_queries", "counter", "Tokens looked up in the engine's prefix cache."),
    Metric("kvtier:prefix_cache_hits", "counter", "Tokens found in the engine's prefix cache."),
    Metric("kvtier:num_preemptions", "counter", "Requests preempted (recomputed later)."),
    Metric("kvtier:request_success", "counter", "Finished requests (each sample of an n > 1 request) by finish reason.",
           ("finished_reason",)),
    Metric("kvtier:kv_blocks_in_use", "gauge", "KV blocks with a ref count above 0 (0 when idle)."),
    Metric("kvtier:kv_block_refs", "gauge", "Sum of the KV blocks' ref counts (0 when idle)."),
    # the connector's totals: one meaning on both servers
    Metric("kvtier:kv_connector_hit_tokens", "counter", "Prompt tokens loaded by the KV connector instead of computed.",
           on=_BOTH),
    Metric("kvtier:kv_load_error_tokens", "counter",
           "Tokens a lookup promised that could not be loaded (recomputed).", on=_BOTH),
    Metric("kvtier:kv_loaded_bytes", "counter", "Bytes of K/V loaded from the tiers.", on=_BOTH),
    Metric("kvtier:kv_load_seconds", "counter",
           "Seconds spent loading: fetching from the tiers and writing into the engine's blocks.", on=_BOTH),
    Metric("kvtier:kv_stored_tokens", "counter", "Tokens of chunks stored into the tiers.", on=_BOTH),
    Metric("kvtier:kv_stored_bytes", "counter", "Bytes of chunks stored into the tiers.", on=_BOTH),
    Metric("kvtier:kv_dropped_store_bytes", "counter", "Chunk bytes not stored: the pending-store budget was full.",
           on=_BOTH),
    Metric("kvtier:kv_tier_hit_tokens", "counter", "Prompt tokens loaded from the tier (as kv_connector_hit_tokens).",
           ("tier",), on=_BOTH),
    # per tier, as the storage manager of kvtier serve's one process sees it
    Metric("kvtier:kv_tier_loaded_bytes", "counter", "Bytes loaded from the tier.", ("tier",)),
    Metric("kvtier:kv_tier_stored_bytes", "counter", "Bytes the tier accepted.", ("tier",)),
    Metric("kvtier:kv_tier_load_seconds", "counter", "Seconds spent loading from the tier.", ("tier",)),
    Metric("kvtier:kv_tier_errors", "counter", "Failed calls to the tier.", ("tier",)),
    Metric("kvtier:kv_tier_timeouts", "counter", "Remote calls that failed or ended past their deadline.", ("tier",)),
    Metric("kvtier:kv_tier_skipped_calls", "counter", "Calls not made: the tier's circuit breaker was open (a miss).",
           ("tier",)),
    Metric("kvtier:kv_tier_breaker_opens", "counter", "Times the tier's circuit breaker (reads or writes) opened.",
           ("tier",)),
    Metric("kvtier:kv_tier_dropped_writes", "counter", "Background writes dropped (queue full).", ("tier",)),
    Metric("kvtier:kv_tier_healthy", "gauge", "1 while the tier is in use, 0 while it backs off.", ("tier",)),
    Metric("kvtier:kv_tier_breaker_state", "gauge", "The tier's circuit breaker: 0 closed, 1 open, 2 half-open.",
           ("tier", "calls")),
    # per tenant label (configured names, "other", "none")
    Metric("kvtier:kv_tenant_hit_tokens", "counter", "Prompt tokens loaded by the KV connector, per tenant.",
           ("tenant",)),
    Metric("kvtier:kv_tenant_loaded_bytes", "counter", "Bytes loaded from the tiers, per tenant.", ("tenant",)),
    Metric("kvtier:kv_tenant_load_seconds", "counter", "Seconds spent loading from the tiers, per tenant.",
           ("tenant",)),
    Metric("kvtier:kv_tenant_stored_tokens", "counter", "Tokens of chunks stored into the tiers, per tenant.",
           ("tenant",)),
    Metric("kvtier:kv_tenant_stored_bytes", "counter", "Bytes of chunks stored into the tiers, per tenant.",
           ("tenant",)),
    # the connector's queues and holds now
    Metric("kvtier:kv_pending_stores", "gauge", "Gathered chunks waiting for the store thread."),
    Metric("kvtier:kv_slow_tier_writes_pending", "gauge", "Background writes to the slower tiers queued or running."),
    Metric("kvtier:kv_load_holds", "gauge", "Load holds on stored chunks (loads in flight); 0 when idle."),
    Metric("kvtier:kv_loads_in_flight", "gauge", "1 while a background load has not ended; 0 when idle."),
    # kvtier router
    Metric("kvtier:router_requests", "counter", "Requests sent to a backend (each try counts).", ("backend", "role"),
           on=_ROUTER),
    Metric("kvtier:router_routed_hit_tokens", "counter",
           "Prompt tokens the chosen backend reported holding (kv-aware).", ("backend",), on=_ROUTER),
    Metric("kvtier:router_backend_errors", "counter",
           "Failed calls to a backend, by kind (connect, timeout, status, stream, lookup).", ("backend", "kind"),
           on=_ROUTER),
    Metric("kvtier:router_lookup_seconds", "histogram", "One kv-aware lookup round over all candidates.", on=_ROUTER),
    Metric("kvtier:router_backend_healthy", "gauge", "1 while the backend is in rotation.", ("backend",), on=_ROUTER),
    Metric("kvtier:router_backend_in_flight", "gauge", "Requests open on the backend.", ("backend",), on=_ROUTER),
    Metric("kvtier:router_prefill_fallbacks", "counter",
           "Disaggregated requests whose prefill backend failed (decode prefilled).", on=_ROUTER),
    Metric("kvtier:router_no_backend", "counter", "Requests refused: no healthy backend (503).", on=_ROUTER),
)
"""Every metric by its name without the `kvtier:` prefix."""
