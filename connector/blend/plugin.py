"""CacheBlend as the connector registers it (connector/extension.py): what pyproject.toml names
under `kvtier.extensions` (`EXTENSION`), with its settings and command-line flags. Light on
purpose: the command line builds every parser at start-up, so this module imports argparse, the
blend's settings and connector/cli_flags.py (which builds its flags from the settings' fields)
only, and its planner and worker when a connector builds them."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from connector.blend.blend_config import BLEND_SETTINGS, BlendConfig
from connector.cli_flags import FieldFlag, config_field
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

KNOB_FLAGS = {"ratio": "R", "check_layer": "L"}
"""The `blend:` keys with a flag of their own (`knob_flag`), each with its metavar; the rest are
set in the config file or the environment."""


def knob_flag(name: str) -> str:
    """Returns the flag of the `blend:` key `name`: `--blend-` and the key with dashes."""
    return f"--{SECTION}-{name.replace('_', '-')}"


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
    for name, metavar in KNOB_FLAGS.items():  # each from its BlendConfig field: help, default, type
        f = config_field(BlendConfig, name)
        b.add_argument(knob_flag(name), dest=f"{SECTION}_{name}", action=FieldFlag, field=lambda f=f: f,
                       metavar=metavar)


def _flag_changes(args: argparse.Namespace) -> Mapping[str, Any] | None:
    """Returns the `blend:` keys the flags set (None: no --blend); ValueError for a knob without --blend."""
    knobs = {k: v for k in KNOB_FLAGS if (v := getattr(args, f"{SECTION}_{k}", None)) is not None}
    if not getattr(args, "blend", False):
        if knobs:
            raise ValueError(f"{'/'.join(map(knob_flag, KNOB_FLAGS))} need --blend")
        return None
    return knobs


EXTENSION = Extension(
    section=SECTION, title="CacheBlend", settings=BLEND_SETTINGS, parse=BlendConfig.from_dict, planner=_planner,
    worker=_worker, whole_chunks=True, in_vllm=False, add_flags=_add_flags, flag_changes=_flag_changes)
"""CacheBlend, as pyproject.toml registers it."""
