"""Engine flags shared by `kvtier generate` and `kvtier serve` (vLLM's names and meanings),
built from `EngineConfig`'s fields (engine/engine_config.py holds each setting's default and help).

Only argparse, engine/engine_config.py and kvtier/cli_help.py (standard library only) are imported here: the CLI builds
every subcommand's parser on start-up.
"""

from __future__ import annotations

import argparse
from typing import Any

from engine.engine_config import EngineConfig
from kvtier.cli_help import KV_CODECS, add_config_arguments, config_flags, device_arg, restrict_choices


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per `EngineConfig` field to `parser` (one argument group): its help,
    default and choices come from the field."""
    add_config_arguments(parser.add_argument_group("engine"), EngineConfig, types={"device": device_arg})


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the engine flags and the KV connector flags (connector/cli_flags.py) to `parser`, with
    --kv-codec restricted to the codecs kvstore has."""
    from connector.cli_flags import add_connector_arguments

    add_engine_arguments(parser)
    add_connector_arguments(parser)
    restrict_choices(parser, "--kv-codec", KV_CODECS)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Returns `LLM(...)` keyword arguments (model first) for the engine flags in `args`."""
    return {f.name: getattr(args, f.name) for _, f in config_flags(EngineConfig)}


def build_llm(args: argparse.Namespace) -> Any:
    """Returns an `LLM` for the engine and connector flags in `args`; a connector built here
    is shut down if the engine then fails to start. Raises ValueError naming a bad flag."""
    from connector.cli_flags import connector_from_args
    from engine import LLM

    connector = connector_from_args(args)  # None without --kv-tier/--config/--blend
    kwargs = engine_kwargs(args)
    try:
        return LLM(kwargs.pop("model"), kv_connector=connector, **kwargs)
    except BaseException:
        if connector is not None:
            connector.shutdown()
        raise
