"""Settings, each declared once: the one home of how kvtier declares a setting, below engine and
kvstore (neither may import the other, and both declare settings). Stdlib only; it imports
nothing of kvtier's, so the engine, kvstore (its cache server too), the connector and the CLI
all take the mechanism from here.

A setting is a dataclass field: its name, type and default are the field's; its metadata
(`opt`) gives its help and what its readers need: a CLI flag's spelling and metavar
(`EngineConfig`, `ServerConfig`: kvtier/cli_help.py `add_config_arguments` builds the flags),
a `KVTIER_*` variable (`env`, its text parsed by `parse`; `field_settings` turns the fields into
the rows `parse_env` reads and docs/configuration.md lists), and `shown` when the reference shows
the default otherwise than `str(default)`.

`ProcessEnv` declares the variables that set no config key (no YAML, no dataclass of their
own): every such `KVTIER_*` variable is read through it, nowhere else.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def opt(help: str, metavar: str | None = None, **extra: Any) -> dict[str, Any]:
    """Returns a setting's dataclass field metadata, so a config declares each key once, in its
    field: its help and metavar, plus what the readers of the field need (`flag`, `choices`,
    `env`, `parse`, `check`, `shown`, `aliases`)."""
    return {"help": help, "metavar": metavar, **extra}


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
    """Returns `text` as it is (a separator's spaces matter; an empty secret is an error its reader names)."""
    return text


def env_optional(var: str, text: str) -> str | None:
    """Returns `text` stripped, or None when it is blank: a blank variable counts as unset."""
    return text.strip() or None


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


def field_default(f: Field[Any]) -> Any:
    """Returns the default of dataclass field `f` (its factory called); MISSING when it has none."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def field_settings(config: Any, prefix: str = "") -> tuple[Setting, ...]:
    """Returns one row per field of the dataclass `config` whose metadata names its variable, in
    field order, each key `prefix` + the field's name (a section's: "blend."). The metadata
    (`opt`) gives `env`, `parse` and `help` (the meaning), `aliases` (older variable names) when
    there are any, and `shown` when the reference shows the default otherwise than the field's
    default does (booleans show as true/false)."""
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
        rows.append(Setting(prefix + f.name, meta["env"], meta["parse"], shown, meta["help"],
                            tuple(meta.get("aliases", ()))))
    return tuple(rows)


def parse_env(settings: Sequence[Setting], env: Mapping[str, str]) -> dict[str, Any]:
    """Returns the keys set by the variables in `env` as a nested mapping, parsed; raises
    ValueError naming a malformed variable. A variable beats its older aliases; one whose
    parser returns None (`env_optional`: blank) counts as unset."""
    out: dict[str, Any] = {}
    for s in settings:
        var = next((v for v in (s.env, *s.aliases) if v in env), None)
        if var is None:
            continue
        value = s.parse(var, env[var])
        if value is None:
            continue
        *parents, leaf = s.key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
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


def flag_of(f: Field[Any]) -> str | None:
    """Returns the CLI flag of setting field `f`: its metadata's `flag` (None: no flag), else
    `--` and its name with dashes; None for a field that is no setting (no `opt` metadata)."""
    if "help" not in f.metadata:
        return None
    flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
    return None if flag is None else str(flag)


def flag_name(config: Any, name: str) -> str | None:
    """Returns the CLI flag of the field `name` of the dataclass (or instance) `config`."""
    return flag_of(next(f for f in fields(config) if f.name == name))


def variable(config: Any, name: str) -> str:
    """Returns the `KVTIER_*` variable the field `name` of the dataclass `config` declares."""
    return str(next(f for f in fields(config) if f.name == name).metadata["env"])


TENANT_TAG_KEY = opt(
    "shared secret (>= 16 bytes): a cache_salt's tenant tag in stored keys is an HMAC under it, so "
    "a reader of a shared tier cannot confirm a guessed salt; every process sharing a tier needs "
    "the same one (unset: the unkeyed tags of before). Read by the connector (its key "
    "`tenant_tag_key`) and by the processes that tag salts without a connector config: "
    "`kvtier cache-server --tenant-tokens`, `kvtier forget-tenant`",
    env="KVTIER_TENANT_TAG_KEY", parse=env_optional, shown="unset")
"""The tenant tag key's one declaration: `ProcessEnv.tenant_tag_key` and the connector's config
key `tenant_tag_key` are this same setting, shown in both tables."""


TIERS_ENV = "KVTIER_TIERS"
"""The variable of kvstore's `tiers` key, which `KVStoreConfig.tiers` declares (its parser, default and
meaning are there). Named here, below engine and kvstore, because setting it alone also enables the KV
connector, which the engine decides (engine/kv_connector.py `CONNECTOR_ENV`) without importing kvstore."""


@dataclass(frozen=True)
class ProcessEnv:
    """The `KVTIER_*` variables that set no config key, one field each: read them with
    `ProcessEnv.read()`, never from `os.environ` by name. Blank `config`, `home` and
    `tenant_tag_key` count as unset; a blank `api_key` or `auth_token` is kept, so its reader can
    refuse it (an empty secret must never mean "no auth")."""

    config: str | None = field(default=None, metadata=opt(
        "the YAML config file (kvtier's keys or LMCache's) when none is given: read by `LLM()`, "
        "`kvtier generate/serve`, vLLM's connector and `KVStoreConfig.load()`; setting it enables the connector",
        env="KVTIER_CONFIG", parse=env_optional, shown="unset"))
    home: str = field(default="~/.cache/kvtier", metadata=opt(
        "where converted model checkpoints and compiled CPU kernels are kept",
        env="KVTIER_HOME", parse=env_optional))
    api_key: str | None = field(default=None, repr=False, metadata=opt(
        "`kvtier serve`/`kvtier router`: the key clients must send as `Authorization: Bearer` when "
        "--api-key is not given; `kvtier cache`: the key it sends",
        env="KVTIER_API_KEY", parse=env_raw, shown="unset"))
    auth_token: str | None = field(default=None, repr=False, metadata=opt(
        "`kvtier cache-server`: the operator's token when --auth-token is not given; a `kvtier://` "
        "tier: the token it sends when its URL has no `auth_token`",
        env="KVTIER_AUTH_TOKEN", parse=env_raw, shown="unset"))
    tenant_tag_key: str | None = field(default=None, repr=False, metadata=TENANT_TAG_KEY)

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None) -> ProcessEnv:
        """Returns the variables set in `env` (default `os.environ`), the defaults for the rest."""
        return cls(**parse_env(PROCESS_SETTINGS, os.environ if env is None else env))


PROCESS_SETTINGS: tuple[Setting, ...] = field_settings(ProcessEnv)
"""`ProcessEnv`'s variables, one row each (docs/configuration.md lists them)."""


def did_you_mean(key: Any, known: Iterable[str]) -> str:
    """Returns " (did you mean X?)" for the closest of `known` to `key`, or "" when none is close."""
    close = difflib.get_close_matches(str(key), list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""
