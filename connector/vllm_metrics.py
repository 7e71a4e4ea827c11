"""kvtier's figures inside vLLM: what the worker role reports each step (`KVTierVllmStats`)
and how `vllm serve`'s /metrics shows it (`KVTierPromMetrics`); docs/vllm.md, "Metrics"."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from connector.metrics import RequestKVMetrics
from connector.vllm_api import KVConnectorPromMetrics, KVConnectorStats

PROM_DOCS = {
    "connector_hit_tokens": "Prompt tokens loaded from kvtier's tiers instead of computed",
    "load_error_tokens": "Tokens promised by a lookup that could not be loaded (recomputed)",
    "bytes_loaded": "Bytes of K/V loaded from kvtier's tiers",
    "load_seconds": "Seconds spent fetching and scattering K/V",
    "stored_tokens": "Tokens of K/V chunks stored into kvtier's tiers",
    "bytes_stored": "Bytes of K/V stored into kvtier's tiers",
    "dropped_store_bytes": "Bytes not stored: the pending-store budget was full",
}
"""The totals the worker reports to vLLM each step, as deltas, with their /metrics help."""

PER_TIER = "loaded_tokens."
"""A stats key `loaded_tokens.<tier>`: tokens loaded from that tier."""


class KVTierVllmStats(KVConnectorStats):
    """What the worker moved since its last report: counter deltas (PROM_DOCS, PER_TIER)."""

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
        return cls(data={k: v for k, v in (data or {}).items() if k in PROM_DOCS or k.startswith(PER_TIER)})


def stats_delta(now: RequestKVMetrics, before: RequestKVMetrics) -> dict[str, float]:
    """Returns what moved from `before` to `now`: PROM_DOCS' counters and tokens loaded per
    tier; only non-zero entries."""
    out: dict[str, float] = {}
    for f in fields(RequestKVMetrics):
        if f.name in PROM_DOCS:
            d = getattr(now, f.name) - getattr(before, f.name)
            if d:
                out[f.name] = d
    for tier, n in now.loaded_tokens_by_tier.items():
        d = n - before.loaded_tokens_by_tier.get(tier, 0)
        if d:
            out[PER_TIER + tier] = d
    return out


class KVTierPromMetrics(KVConnectorPromMetrics):
    """kvtier's figures on `vllm serve`'s /metrics: `kvtier:<counter>_total` per engine, and
    `kvtier:loaded_tokens_total` per tier."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._values = per_engine_labelvalues
        self._counters = {name: self._counter_cls(name=f"kvtier:{name}", documentation=doc, labelnames=labelnames)
                          for name, doc in PROM_DOCS.items()}
        self._by_tier = self._counter_cls(name="kvtier:loaded_tokens", documentation="Tokens loaded, per tier",
                                          labelnames=[*labelnames, "tier"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self._values[engine_idx]
        for key, delta in transfer_stats_data.items():
            if key in self._counters:
                self._counters[key].labels(*values).inc(delta)
            elif key.startswith(PER_TIER):
                self._by_tier.labels(*values, key.removeprefix(PER_TIER)).inc(delta)
