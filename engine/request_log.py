"""One INFO line per finished request, on logger "kvtier.request", as LMCache logs its hit
counts: its tokens, where its cached prefix came from (the engine's prefix cache, a
connector's tiers), load time and what the connector stored. `kvtier serve` and
`kvtier generate` show it at their default --log-level info.
"""

from __future__ import annotations

import json
import logging

from engine.kv_connector import KVConnectorScheduler
from engine.sequence import Sequence

request_logger = logging.getLogger("kvtier.request")


def log_finished(seq: Sequence, connector: KVConnectorScheduler | None) -> None:
    """Logs the line for finished `seq`; the connector part when `connector` keeps request
    figures (`request_metrics`, connector/connector_metrics.py's RequestKVMetrics). Stores still queued
    when the request finished are not in it (they show in `request_metrics` later)."""
    if not request_logger.isEnabledFor(logging.INFO):
        return
    cached = max(seq.num_cached_tokens, 0)
    fields = [f"prompt_tokens={seq.num_prompt_tokens}"]
    m = connector.request_metrics(seq.request_id) if connector is not None else None
    if m is None:
        fields.append(f"engine_hit_tokens={cached}")
    else:
        # The connector records the engine's hit when it is asked; never asked, every cached
        # token is the engine's own.
        engine_hit = m.engine_hit_tokens if m.num_prompt_tokens else cached
        fields += [f"engine_hit_tokens={engine_hit}", f"loaded_tokens={m.connector_hit_tokens}"]
        by_tier = getattr(m, "loaded_tokens_by_tier", None)
        if by_tier:  # tier names are URLs: JSON keeps them unambiguous
            fields.append(f"loaded_tokens_by_tier={json.dumps(by_tier, separators=(',', ':'))}")
        fields.append(f"load_ms={m.load_seconds * 1e3:.1f}")
        if m.load_error_tokens:
            fields.append(f"load_error_tokens={m.load_error_tokens}")
        fields.append(f"stored_tokens={m.stored_tokens}")
    fields += [f"output_tokens={seq.num_output_tokens}", f"finish={seq.status.value}"]
    request_logger.info("request %s finished: %s", seq.request_id, " ".join(fields))
