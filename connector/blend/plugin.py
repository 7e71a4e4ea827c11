"""CacheBlend as the connector registers it (connector/extension.py): what pyproject.toml names
under `kvtier.extensions` (`EXTENSION`), with its settings and command-line flags. Light on
purpose: the command line builds every parser at start-up, so this module imports argparse and
the blend's settings only, and its planner and worker when a connector builds them."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from connector.blend.blend_config import BLEND_SETTINGS, BlendConfig
from connector.extension import Extension

if TYPE_CHECKING:
    import torch

    from connector.connector_metrics import ConnectorMetrics
    from connector.extension import PlannerExtension, WorkerExtension
    from connector.presence import Presence
    from connector.store_queue import StoreQueue
    from engine.kv_cache import KeyedModel, PagedKVLayout
    from kvkeys.keyspace import Keyspace
    from kvstore.storage_manager import StorageManager

SECTION = "blend"


def _planner(config: Any, presence: Presence, metrics: ConnectorMetrics) -> PlannerExtension:
    from connector.blend.blend_planner import BlendPlanner

    return BlendPlanner(config, presence, metrics)


def _worker(config: Any, storage: StorageManager, stores: StoreQueue, layout: PagedKVLayout, keyspace: Keyspace,
            metrics: ConnectorMetrics, model_config: KeyedModel, model: torch.nn.Module | None) -> WorkerExtension:
    from connector.blend.blender import new_blender

    return new_blender(config, storage, stores, layout, keyspace, metrics, model_config, model)


def _add_flags(parser: argparse.ArgumentParser) -> None:
    b = parser.add_argument_group("CacheBlend (reuse documents' KV in any position; prompt segments "
                                  "separated by ' # # ')")
    b.add_argument("--blend", action="store_true",
                   help="blend segmented prompts (default tiers when no --kv-tier/--config)")
    b.add_argument("--blend-ratio", type=float, default=None, metavar="R",
                   help="fraction of segment tokens recomputed (default 0.15; 0 = plain reuse, 1 = full prefill)")
    b.add_argument("--blend-check-layer", type=int, default=None, metavar="L",
                   help="layer at which the recomputed tokens are selected (default 1)")


def _flag_changes(args: argparse.Namespace) -> Mapping[str, Any] | None:
    """Returns the `blend:` keys the flags set (None: no --blend); ValueError for a knob without --blend."""
    knobs = {k: v for k, v in (("ratio", getattr(args, "blend_ratio", None)),
                               ("check_layer", getattr(args, "blend_check_layer", None))) if v is not None}
    if not getattr(args, "blend", False):
        if knobs:
            raise ValueError("--blend-ratio/--blend-check-layer need --blend")
        return None
    return knobs


EXTENSION = Extension(
    section=SECTION, title="CacheBlend", settings=BLEND_SETTINGS, parse=BlendConfig.from_dict, planner=_planner,
    worker=_worker, whole_chunks=True, in_vllm=False, add_flags=_add_flags, flag_changes=_flag_changes)
"""CacheBlend, as pyproject.toml registers it."""
