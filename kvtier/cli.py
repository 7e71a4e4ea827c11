"""The `kvtier` command: one entry point, one module per subcommand.

Each subcommand module exposes `HELP: str`, `add_arguments(parser)` and `run(args) -> int`;
it is imported only when chosen, so `kvtier cache-server` never loads the model stack.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module implementing it
SUBCOMMANDS: dict[str, str] = {
    "generate": "kvtier.cmd_generate",
    "serve": "kvtier.cmd_serve",
    "cache-server": "kvtier.cmd_cache_server",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs one subcommand; a ValueError becomes a one-line error and exit code 2."""
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except ValueError as exc:
        print(f"kvtier {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
