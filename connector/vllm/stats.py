"""kvtier's figures inside vLLM: what the worker role reports each step (`KVTierVllmStats`)
and how `vllm serve`'s /metrics shows it (`KVTierPromMetrics`); docs/vllm.md, "Metrics"."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from connector.connector_metrics import PROM_COUNTERS, TIER_HIT_TOKENS, ConnectorMetrics, RequestKVMetrics
from connector.vllm.vllm_api import KVConnectorPromMetrics, KVConnectorStats

PER_TIER = "loaded_tokens."
"""A stats key `loaded_tokens.<tier>`: tokens loaded from that tier."""


class KVTierVllmStats(KVConnectorStats):
    """What the worker moved since its last report: counter deltas (PROM_COUNTERS, PER_TIER)."""

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())

    @classmethod
    def of(cls, data: dict[str, Any] | None) -> KVTierVllmStats:
        """Returns the stats of `data`'s known keys (vLLM hands them over as a plain dict)."""
        return cls(data={k: v for k, v in (data or {}).items() if k in PROM_COUNTERS or k.startswith(PER_TIER)})


class StatsReports:
    """The worker role's figures since its last report (`report`)."""

    def __init__(self, metrics: ConnectorMetrics, rank: int) -> None:
        self.metrics = metrics
        self.rank = rank
        self._reported = RequestKVMetrics("*")

    def report(self) -> KVTierVllmStats | None:
        """Returns what moved since the last report, rank 0's only (every rank loads and stores
        the same tokens, its own heads of them, and vLLM adds up what ranks report); None when
        nothing moved."""
        if self.rank:
            return None
        now = self.metrics.totals_now()
        delta = stats_delta(now, self._reported)
        self._reported = now
        return KVTierVllmStats(data=delta) if delta else None


def stats_delta(now: RequestKVMetrics, before: RequestKVMetrics) -> dict[str, float]:
    """Returns what moved from `before` to `now`: PROM_COUNTERS' fields and tokens loaded per
    tier; only non-zero entries."""
    out: dict[str, float] = {}
    for f in fields(RequestKVMetrics):
        if f.name in PROM_COUNTERS:
            d = getattr(now, f.name) - getattr(before, f.name)
            if d:
                out[f.name] = d
    for tier, n in now.loaded_tokens_by_tier.items():
        d = n - before.loaded_tokens_by_tier.get(tier, 0)
        if d:
            out[PER_TIER + tier] = d
    return out


class KVTierPromMetrics(KVConnectorPromMetrics):
    """kvtier's figures on `vllm serve`'s /metrics, per engine: the metric table's rows this
    deployment computes (connector/metric_table.py, `on` "vllm": PROM_COUNTERS and
    TIER_HIT_TOKENS per tier), under the same names and meanings as on `kvtier serve`."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._values = per_engine_labelvalues
        self._counters = {field: self._counter_cls(name=m.name, documentation=m.doc, labelnames=labelnames)
                          for field, m in PROM_COUNTERS.items()}
        self._by_tier = self._counter_cls(name=TIER_HIT_TOKENS.name, documentation=TIER_HIT_TOKENS.doc,
                                          labelnames=[*labelnames, *TIER_HIT_TOKENS.labels])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self._values[engine_idx]
        for key, delta in transfer_stats_data.items():
            if key in self._counters:
                self._counters[key].labels(*values).inc(delta)
            elif key.startswith(PER_TIER):
                self._by_tier.labels(*values, key.removeprefix(PER_TIER)).inc(delta)
