"""`KVTIER_*` environment variables: one table row per config key drives both the parsing and
the configuration reference (docs/configuration.md), so the two cannot drift.

Each section of the config (kvstore's keys here, the connector's and CacheBlend's in
`connector`) declares its rows, as a table or in its dataclass fields' metadata
(`field_settings`); `parse_env` turns the variables present into a nested mapping
(`blend.ratio` -> `{"blend": {"ratio": ...}}`) that is merged over the YAML.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_bool(var: str, text: str) -> bool:
    """Returns `text` as a boolean (1/0, true/false, yes/no, on/off); ValueError naming `var`."""
    low = text.strip().lower()
    if low not in _TRUE + _FALSE:
        raise ValueError(f"{var}: expected a boolean (1/0/true/false), got {text!r}")
    return low in _TRUE


def env_int(var: str, text: str) -> int:
    """Returns `text` as an int; ValueError naming `var`."""
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{var}: expected int, got {text!r}") from None


def env_float(var: str, text: str) -> float:
    """Returns `text` as a float; ValueError naming `var`."""
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError(f"{var}: expected float, got {text!r}") from None


def env_str(var: str, text: str) -> str:
    """Returns `text` stripped (sizes and names are validated by the config itself)."""
    return text.strip()


def env_raw(var: str, text: str) -> str:
    """Returns `text` as it is (a separator's spaces matter)."""
    return text


@dataclass(frozen=True)
class Setting:
    """One config key: its YAML name (dotted inside a section), its `KVTIER_*` variable (plus
    older accepted names), how the variable's text parses, and its default and meaning as the
    reference shows them."""

    key: str
    env: str
    parse: Callable[[str, str], Any]
    default: str
    meaning: str
    aliases: tuple[str, ...] = ()


def field_settings(config: Any) -> tuple[Setting, ...]:
    """Returns one row per field of the dataclass `config` whose metadata names its variable, in
    field order. The metadata (engine.engine_config.opt builds it) gives `env`, `parse` and `help` (the
    meaning), and `shown` when the reference shows the default otherwise than the field's default
    does (booleans show as true/false)."""
    rows = []
    for f in fields(config):
        meta = f.metadata
        if "env" not in meta:
            continue
        if "shown" in meta:
            shown = meta["shown"]
        elif f.default is MISSING:
            raise ValueError(f"{f.name}: a setting without a plain default needs metadata `shown`")
        else:
            shown = str(f.default).lower() if isinstance(f.default, bool) else str(f.default)
        rows.append(Setting(f.name, meta["env"], meta["parse"], shown, meta["help"]))
    return tuple(rows)


def parse_env(settings: Sequence[Setting], env: Mapping[str, str]) -> dict[str, Any]:
    """Returns the keys set by the variables in `env` as a nested mapping, parsed; raises
    ValueError naming a malformed variable. A variable beats its older aliases."""
    out: dict[str, Any] = {}
    for s in settings:
        var = next((v for v in (s.env, *s.aliases) if v in env), None)
        if var is None:
            continue
        *parents, leaf = s.key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = s.parse(var, env[var])
    return out


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Returns `base` with `over` applied: nested mappings merge key by key, anything else is
    replaced (a section given as a bare bool, like `blend: true`, counts as `{enabled: ...}`)."""
    out = dict(base)
    for key, value in over.items():
        old = out.get(key)
        if isinstance(value, Mapping) and isinstance(old, bool):
            old = {"enabled": old}
        if isinstance(value, Mapping) and isinstance(old, Mapping):
            out[key] = merge(old, value)
        else:
            out[key] = value
    return out
