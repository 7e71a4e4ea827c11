"""Conventions every kvtier subcommand's flags share: help shows each default, values use one
metavar style, fixed vocabularies are `choices` checked by argparse (before any heavy import).

Metavar style: a value is an UPPERCASE word naming its kind (N, FILE, DIR, URL, SIZE, SECONDS,
...); a fixed vocabulary shows its choices instead ({auto,cpu,...}).
Only argparse and re are imported here: the CLI builds every parser on start-up.
"""

from __future__ import annotations

import argparse
import re

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
