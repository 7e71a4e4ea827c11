"""What a user asks of a connector that blends (CacheBlend, connector/blend/plugin.py): its totals,
a stored segment's K/V, and its knobs changed between requests."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from connector.blend.blend_planner import BlendPlanner
from connector.blend.blender import Blender
from connector.blend.plugin import SECTION
from connector.engine_connector import EngineConnector


def blender(conn: EngineConnector) -> Blender:
    """Returns the worker side's CacheBlend; ValueError when the connector does not blend."""
    ext = conn.worker.extension
    if not isinstance(ext, Blender):
        raise ValueError("CacheBlend is not configured (blend.enabled) or has no engine yet")
    return ext


def blend_stats(conn: EngineConnector) -> dict[str, Any]:
    """Returns CacheBlend's totals since start-up; ValueError when the connector does not blend."""
    return blender(conn).stats.to_dict()


def stored_segment(conn: EngineConnector, token_ids: Sequence[int], segment_kv: str | None = None,
                   cache_salt: str | None = None) -> torch.Tensor | None:
    """Returns the stored K/V `(L, 2, n, H, D)` of a segment at positions 0.. of kind
    `segment_kv` (default: the config's) stored for requests of `cache_salt`, or None unless all
    of it is stored and well-formed. Read only (it may be a tier's own tensor)."""
    b = blender(conn)
    spans = b.keyspace.for_salt(cache_salt).segment_spans(token_ids, segment_kv or b.config.segment_kv)
    return b.fetch_segment(spans)[0]


def set_blend(conn: EngineConnector, **changes: Any) -> None:
    """Changes CacheBlend's knobs (ratio, segment_kv, check_layer, ...) on both halves,
    validated; for experiments between requests."""
    b = blender(conn)
    layout = conn.worker.layout
    config = dataclasses.replace(b.config, **changes).validate(layout.num_layers if layout is not None else None)
    conn.config.extensions[SECTION] = config
    b.config = config
    if isinstance(conn.planner.extension, BlendPlanner):
        conn.planner.extension.config = config
