"""Prometheus metrics of one server, named `kvtier:*` as vLLM names its own `vllm:*`.

Engine-side values are updated by the engine thread after every step (`on_step`), so a
scrape never reads engine state mid-step; the block and ref counts a leak check reads at idle
points are read at scrape time (`EngineCollector`: exact when idle, at most a step stale
otherwise). Per-tier connector figures, circuit breakers included, are read at scrape time
from the connector's thread-safe counters (`ConnectorCollector`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from connector.connector_metrics import PROM_COUNTERS, TIER_HIT_TOKENS
from connector.engine_connector import EngineConnector
from connector.metric_table import METRICS, Metric
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from kvkeys.tenants import tenant_tag

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    """The server's registry and the engine thread's hooks that keep it current."""

    def __init__(self, model_name: str, connector: Any = None) -> None:
        disable_created_metrics()  # no `*_created` series: vLLM's exposition has none either
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def gauge(short: str) -> Any:
            return Gauge(METRICS[short].name, METRICS[short].doc, labels, registry=r).labels(model_name)

        def counter(short: str) -> Any:
            return Counter(METRICS[short].name, METRICS[short].doc, labels, registry=r).labels(model_name)

        def histogram(short: str, buckets: tuple[float, ...]) -> Any:
            m = METRICS[short]
            return Histogram(m.name, m.doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("num_requests_running")
        self.waiting = gauge("num_requests_waiting")
        self.kv_usage = gauge("kv_cache_usage_perc")
        self.ttft = histogram("time_to_first_token_seconds", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", _E2E_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens")
        self.generation_tokens = counter("generation_tokens")
        self.prefix_queries = counter("prefix_cache_queries")
        self.prefix_hits = counter("prefix_cache_hits")
        self.preemptions = counter("num_preemptions")
        hits = PROM_COUNTERS["connector_hit_tokens"]
        self.external_hits = Counter(hits.name, hits.doc, labels, registry=r).labels(model_name)
        done = METRICS["request_success"]
        self._finished = Counter(done.name, done.doc, [*labels, *done.labels], registry=r)
        self._model_name = model_name
        self._last: dict[str, int] = {}
        # request -> sample index -> (tokens, last token time); samples already counted finished
        self._tokens_seen: dict[str, dict[int, tuple[int, float]]] = {}
        self._finished_samples: dict[str, set[int]] = {}
        self._connector = connector
        if isinstance(connector, EngineConnector):
            r.register(ConnectorCollector(connector))

    def label_tenants(self, names: Mapping[str, str]) -> None:
        """Labels the per-tenant figures of each salt in `names` (cache salt -> tenant name) with
        its name; other salts are "other" (the salt itself is never a label: it is a secret)."""
        connector = self._connector
        if isinstance(connector, EngineConnector):
            connector.metrics.tenant_names = {tenant_tag(salt): name for salt, name in names.items()}

    def watch_engine(self, engine: LLMEngine) -> None:
        """Adds the engine's block and ref counts, read at each scrape."""
        self.registry.register(EngineCollector(engine))

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """Engine thread: records the step's tokens and the engine's counters and gauges. An
        n > 1 request's samples each count their tokens, gaps and finish; the request counts
        its prompt, first token and end-to-end time once."""
        now = time.monotonic()
        for out in outputs:
            rid = out.request_id
            seen_by_sample = self._tokens_seen.get(rid)
            if seen_by_sample is None:  # its first output: a token, or a finished scoring request
                seen_by_sample = self._tokens_seen[rid] = {}
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                if out.metrics is not None and out.metrics.ttft is not None:
                    self.ttft.observe(out.metrics.ttft)
            for c in out.outputs:
                n = len(c.token_ids)
                seen, last = seen_by_sample.get(c.index, (0, 0.0))
                if seen and n > seen:
                    self.itl.observe((now - last) / (n - seen))
                if n > seen:
                    self.generation_tokens.inc(n - seen)
                    seen_by_sample[c.index] = (n, now)
                if c.finish_reason is not None and c.index not in self._finished_samples.setdefault(rid, set()):
                    self._finished_samples[rid].add(c.index)
                    self._finished.labels(self._model_name, c.finish_reason).inc()
            if out.finished:
                self._tokens_seen.pop(rid, None)
                self._finished_samples.pop(rid, None)
                if out.metrics is not None:
                    self.e2e.observe(now - out.metrics.arrival_time)
        stats = engine.get_stats()
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.kv_usage.set(stats["block_usage"])
        for key, metric in (("prefix_cache_queries", self.prefix_queries), ("prefix_cache_hits", self.prefix_hits),
                            ("num_preemptions", self.preemptions), ("connector_hit_tokens", self.external_hits)):
            delta = stats[key] - self._last.get(key, 0)
            if delta > 0:
                metric.inc(delta)
            self._last[key] = stats[key]

    def forget(self, request_id: str) -> None:
        """Engine thread: counts an aborted request and drops its token record."""
        self._tokens_seen.pop(request_id, None)
        self._finished_samples.pop(request_id, None)
        self._finished.labels(self._model_name, "abort").inc()


class ConnectorCollector(Collector):
    """Per-tier connector figures (label `tier`), read from the connector at scrape time."""

    def __init__(self, connector: EngineConnector) -> None:
        self.connector = connector

    def collect(self) -> Iterator[Any]:
        tiers = self.connector.tier_metrics()
        per_tier = {  # TierKVMetrics field -> its metric
            "tokens_hit": TIER_HIT_TOKENS, "bytes_loaded": METRICS["kv_tier_loaded_bytes"],
            "bytes_stored": METRICS["kv_tier_stored_bytes"], "load_seconds": METRICS["kv_tier_load_seconds"],
            "errors": METRICS["kv_tier_errors"], "timeouts": METRICS["kv_tier_timeouts"],
            "skipped": METRICS["kv_tier_skipped_calls"], "breaker_opens": METRICS["kv_tier_breaker_opens"],
            "dropped_writes": METRICS["kv_tier_dropped_writes"],
        }
        families = {attr: _family(m) for attr, m in per_tier.items()}
        healthy, breaker = _family(METRICS["kv_tier_healthy"]), _family(METRICS["kv_tier_breaker_state"])
        for t in tiers:
            for attr, fam in families.items():
                fam.add_metric([t.name], float(getattr(t, attr)))
            healthy.add_metric([t.name], 1.0 if t.healthy else 0.0)
            breaker.add_metric([t.name, "reads"], float(t.read_breaker))
            breaker.add_metric([t.name, "writes"], float(t.write_breaker))
        yield from families.values()
        yield healthy
        yield breaker
        yield from self._tenant_families()
        totals = self.connector.metrics.totals
        for field, m in PROM_COUNTERS.items():
            if field != "connector_hit_tokens":  # the engine's own count, ServerMetrics.external_hits
                counter = _family(m)
                counter.add_metric([], float(getattr(totals, field)))
                yield counter
        storage = self.connector.storage
        for short, value in (("kv_pending_stores", self.connector.pending_stores()),
                             ("kv_slow_tier_writes_pending", storage.writer_stats()["pending"]),
                             ("kv_load_holds", storage.holds.total()),
                             ("kv_loads_in_flight", int(self.connector.worker.loads_in_flight()))):
            g = _family(METRICS[short])
            g.add_metric([], float(value))
            yield g

    def _tenant_families(self) -> Iterator[Any]:
        """Hit, load and store figures per tenant label (bounded: configured names, "other",
        "none" for unsalted requests; connector/connector_metrics.py)."""
        totals = self.connector.metrics.tenant_totals()
        for attr, short in (("connector_hit_tokens", "kv_tenant_hit_tokens"),
                            ("bytes_loaded", "kv_tenant_loaded_bytes"), ("load_seconds", "kv_tenant_load_seconds"),
                            ("stored_tokens", "kv_tenant_stored_tokens"), ("bytes_stored", "kv_tenant_stored_bytes")):
            fam = _family(METRICS[short])
            for label, figures in totals.items():
                fam.add_metric([label], float(figures[attr]))
            yield fam


def _family(m: Metric) -> Any:
    """Returns an empty scrape-time family of metric `m` (a counter or a gauge), with its labels."""
    cls = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
    return cls(m.name, m.doc, labels=list(m.labels))


class EngineCollector(Collector):
    """The engine's KV blocks in use and the sum of their ref counts, read at scrape time (a
    leak shows as either staying above 0 once the server is idle)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        # Off the engine thread on purpose (a scrape at an idle point must see the state now):
        # len() and the ref_cnt ints are read atomically under the GIL, never torn.
        blocks = self.engine.block_manager
        refs = blocks.ref_counts()
        for short, value in (("kv_blocks_in_use", sum(1 for r in refs if r)), ("kv_block_refs", sum(refs))):
            g = _family(METRICS[short])
            g.add_metric([], float(value))
            yield g
