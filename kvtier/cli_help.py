"""Conventions every kvtier subcommand's flags share: help shows each default, values use one
metavar style, fixed vocabularies are `choices` checked by argparse (before any heavy import).

Metavar style: a value is an UPPERCASE word naming its kind (N, FILE, DIR, URL, SIZE, SECONDS,
...); a fixed vocabulary shows its choices instead ({auto,cpu,...}).
A config whose fields are declared with `kvsettings.opt` (EngineConfig, the cache server's
ServerConfig and StoreBudgets, the router's RouterConfig) gets its flags from those fields
(`add_config_arguments`): flag, default, metavar, choices and help are written once, in the field.
Only argparse, re, dataclasses and kvsettings (standard library only) are imported here: the CLI
builds every parser on start-up.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import Field, fields
from typing import Any

from kvsettings import field_default, flag_of

# The codecs kvstore/codecs.py registers (CODEC_NAMES there imports torch, so the list is
# repeated here; tests/kvtier/test_cli.py keeps the two equal).
KV_CODECS = ("raw", "lz4", "int8", "int4")

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:[0-9]+)?)$")
_DEFAULT_NO_COLON = re.compile(r"\(default (?=[0-9])")  # "(default 256)" -> "(default: 256)"


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter with every option's default in its help, in one form
    "(default: X)"; help that already explains its default keeps its own words."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return help_with_default(action)


def help_with_default(action: argparse.Action) -> str:
    """Returns `action`'s help ending in "(default: X)": kept when the help names its default,
    else appended (off for a switch, none for an unset value)."""
    text = _DEFAULT_NO_COLON.sub("(default: ", action.help or "")
    if "(default:" in text or not action.option_strings or action.default is argparse.SUPPRESS:
        return text
    if action.nargs == 0:  # store_true and the like
        shown = "on" if action.default else "off"
    elif action.default is None or action.default == []:
        shown = "none"
    else:
        shown = str(action.default)
    return f"{text} (default: {shown})".strip()


def device_arg(text: str) -> str:
    """argparse type of --device: returns `text` if it is auto, cpu, cuda or cuda:N (whether
    that device exists is checked when the engine starts); argparse error otherwise."""
    if not _DEVICE_RE.match(text):
        raise argparse.ArgumentTypeError(f"invalid device {text!r}: use auto, cpu, cuda or cuda:N")
    return text


def restrict_choices(parser: argparse.ArgumentParser, option: str, choices: tuple[str, ...]) -> None:
    """Gives an option another module added (e.g. connector/cli_flags.py's --kv-codec) a fixed
    vocabulary, so argparse rejects a bad value with this parser's usage."""
    action = parser._option_string_actions[option]  # argparse keeps no public lookup
    action.choices = choices
    action.metavar = None  # show the choices, per the metavar style


def has_option(parser: argparse.ArgumentParser, option: str) -> bool:
    """Returns whether `parser` already defines `option`."""
    return option in parser._option_string_actions


def config_flags(config: Any) -> list[tuple[str, Field[Any]]]:
    """Returns (flag, field) for every field of the dataclass `config` that has a flag."""
    return [(flag, f) for f in fields(config) if (flag := flag_of(f)) is not None]


def add_config_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, config: Any,
                         names: Sequence[str] | None = None,
                         types: Mapping[str, Callable[[str], Any]] | None = None) -> None:
    """Adds one flag per field of the dataclass `config` that has one (only `names`, in that
    order, when given), all from the field: its default, metavar, choices and help (plus
    "(default: X)" when its metadata `shown` says how the default reads); the value is the
    field's `dest`. A boolean is a switch that turns its default over; a value's text parses by
    `types[name]`, else the metadata's `parse(flag, text)`, else the field's type (int, float, str;
    a list's values are str, and its metadata `action="append"` makes the flag repeatable)."""
    rows = {f.name: (flag, f) for flag, f in config_flags(config)}
    for name in names or list(rows):
        flag, f = rows[name]
        meta = f.metadata
        default = field_default(f)
        text = meta["help"] + (f" (default: {meta['shown']})" if "shown" in meta else "")
        if isinstance(default, bool):
            parser.add_argument(flag, dest=name, action="store_false" if default else "store_true", help=text)
            continue
        kind = (types or {}).get(name)
        if kind is None:
            kind = (_flag_parser(flag, meta["parse"]) if "parse" in meta
                    else {"int": int, "float": float}.get(str(f.type).split(" | ")[0], str))
        if meta.get("action") == "append":  # repeatable: each use adds one value to the (fresh) default list
            parser.add_argument(flag, dest=name, action="append", default=default, metavar=meta["metavar"],
                                type=kind, help=text)
            continue
        choices = list(meta["choices"]) if "choices" in meta else None
        parser.add_argument(flag, dest=name, default=default, metavar=meta["metavar"], choices=choices, type=kind,
                            help=text)


def _flag_parser(flag: str, parse: Callable[[str, str], Any]) -> Callable[[str], Any]:
    """Returns argparse's `type` for a field parsed by `parse(flag, text)`: its ValueError becomes
    argparse's error for `flag`."""
    def convert(text: str) -> Any:
        try:
            return parse(flag, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag}: ")) from None

    return convert
