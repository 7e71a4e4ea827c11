"""`--log-level`, which every subcommand has, and the one place that configures logging.

The level also decides progress bars (engine/progress.py): they show at debug and info, on a
terminal only. Only argparse and logging are imported here.
"""

from __future__ import annotations

import argparse
import logging

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# What the levels show for the commands that run the engine (generate, serve).
ENGINE_LOG_HELP = "info shows one line per finished request and, on a terminal, progress bars for model loading " \
                  "and long prefills"


def add_log_level_argument(parser: argparse.ArgumentParser, default: str = "info", detail: str = "") -> None:
    """Adds `--log-level` (case-insensitive, one of LOG_LEVELS) to `parser`; `detail` says
    what the levels show for this command."""
    parser.add_argument("--log-level", default=default, type=str.lower, choices=LOG_LEVELS,
                        help=f"log level; {detail}" if detail else "log level")


def configure_logging(level: str) -> None:
    """Sends log records at `level` and above to stderr, one line each. Idempotent: a second
    call only changes the level (no second handler, so no doubled lines)."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format=LOG_FORMAT)
    root.setLevel(level.upper())
