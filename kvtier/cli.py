"""kvtier: offload and reuse LLM KV cache across GPU, CPU, disk, Redis and a cache server.

Run the paged engine on prompts (`generate`), serve it over an OpenAI-compatible HTTP API
with KV reuse (`serve`), or run the standalone KV cache server engines share (`cache-server`).

Each subcommand module exposes `HELP: str`, `add_arguments(parser)` and `run(args) -> int`
(and may set `DEFAULT_LOG_LEVEL`, `LOG_LEVEL_HELP`); its heavy imports happen in `run`, so a bad flag fails
before torch loads and `kvtier cache-server` never loads the model stack. Exit codes: 0 done,
2 bad input (a flag, a file or a config the user named), 1 a failure at run time.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvtier import __version__
from kvtier.cli_help import HelpFormatter, has_option
from kvtier.log_setup import add_log_level_argument, configure_logging

# subcommand name -> module implementing it
SUBCOMMANDS: dict[str, str] = {
    "generate": "kvtier.cmd_generate",
    "serve": "kvtier.cmd_serve",
    "cache-server": "kvtier.cmd_cache_server",
    "router": "kvtier.cmd_router",
    "forget-tenant": "kvtier.cmd_forget_tenant",
    "cache": "kvtier.cmd_cache",
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """Returns the top-level parser and each subcommand's own parser."""
    doc = (__doc__ or "").split("\n\nEach subcommand")[0]
    parser = argparse.ArgumentParser(prog="kvtier", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers = {}
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP, formatter_class=HelpFormatter)
        module.add_arguments(p)
        if not has_option(p, "--log-level"):
            add_log_level_argument(p, getattr(module, "DEFAULT_LOG_LEVEL", "info"),
                                   getattr(module, "LOG_LEVEL_HELP", ""))
        p.set_defaults(_run=module.run)
        subparsers[name] = p
    return parser, subparsers


def main(argv: list[str] | None = None) -> int:
    """Runs one subcommand after configuring logging once (subcommands never do); returns
    its exit code. A ValueError becomes a one-line error and exit code 2."""
    parser, subparsers = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if extra:  # a typo'd flag: answer with the subcommand's usage, not the top level's
        subparsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    configure_logging(args.log_level)
    from tqdm.contrib.logging import logging_redirect_tqdm

    try:
        with logging_redirect_tqdm():  # log lines print above a progress bar, not through it
            return int(args._run(args) or 0)
    except ValueError as exc:
        print(f"kvtier {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
