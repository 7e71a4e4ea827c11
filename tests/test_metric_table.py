"""One metric table (connector/metric_table.py): every `kvtier:*` metric name in the shipped code
is a row of it, written nowhere else, and each server exposes exactly the rows marked for it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from connector.connector_metrics import PROM_COUNTERS, TIER_HIT_TOKENS
from connector.engine_connector import build_connector
from connector.metric_table import METRICS
from kvtier.server.server_metrics import ServerMetrics

REPO = Path(__file__).resolve().parents[1]
SHIPPED = ("engine", "kvstore", "connector", "kvtier", "kvkeys", "kvsettings", "hostmem")
NAME = re.compile(r"kvtier:[a-z][a-z0-9_]*")


def test_every_metric_name_is_written_in_the_table_only() -> None:
    found = []
    for package in SHIPPED:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel == "connector/metric_table.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                    found.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not found, "metric names written outside connector/metric_table.py:\n" + "\n".join(found)


def test_the_rows_are_well_formed() -> None:
    for short, m in METRICS.items():
        assert m.name == "kvtier:" + short and NAME.fullmatch(m.name), m
        assert m.kind in ("counter", "gauge", "histogram") and m.doc.endswith(".") and m.on, m
        assert m.on <= {"serve", "vllm", "router"}, m
    assert [m.name for m in METRICS.values() if m.on == {"router"}] == \
        [m.name for m in METRICS.values() if m.name.startswith("kvtier:router_")]


def test_each_server_exposes_the_rows_marked_for_it() -> None:
    """kvtier serve's registry (a real connector over a cpu tier; the engine's two gauges are
    EngineCollector's) and vllm serve's counters (connector/vllm/stats.py renders PROM_COUNTERS
    and TIER_HIT_TOKENS) against the table."""
    conn = build_connector(["cpu"])
    try:
        metrics = ServerMetrics("m", conn)
        metrics.running.set(0)
        exposed = {f.name for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    finally:
        conn.shutdown()
    engine_gauges = {m.name for m in (METRICS["kv_blocks_in_use"], METRICS["kv_block_refs"])}
    assert exposed | engine_gauges == {m.name for m in METRICS.values() if "serve" in m.on}
    vllm = {m.name for m in PROM_COUNTERS.values()} | {TIER_HIT_TOKENS.name}
    assert vllm == {m.name for m in METRICS.values() if "vllm" in m.on}
