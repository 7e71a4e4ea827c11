"""Command-line flags that enable the connector (`kvtier generate`, examples, benchmarks).

`--kv-tier URL` (repeatable, fastest first), `--chunk-size`, `--kv-codec`, `--config FILE`;
and each registered extension's own (connector/extension.py; CacheBlend: `--blend`,
`--blend-ratio R`, `--blend-check-layer L`). With neither `--kv-tier`, `--config` nor an
extension's flag, there is a connector only when the
environment names one (KVTIER_CONFIG, KVTIER_TIERS or LMCACHE_CONFIG_FILE, as `LLM()` reads
it); every `KVTIER_*` variable applies on top of `--config`. Only argparse, dataclasses and
kvsettings (standard library only) are imported at module level: the CLI builds every
subcommand's parser on start-up.

A flag that sets one config key only when given (`--chunk-size`, `--blend-ratio`, ...) is a
`FieldFlag`: its help, shown default and type are the key's dataclass field's, written once there.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import Field, fields
from typing import TYPE_CHECKING, Any

from kvsettings import field_default

if TYPE_CHECKING:
    from connector.engine_connector import EngineConnector

_TYPES: dict[str, Callable[[str], Any]] = {"int": int, "float": float}


def config_field(config: Any, name: str) -> Field[Any]:
    """Returns the field `name` of the dataclass `config`."""
    return next(f for f in fields(config) if f.name == name)


def _chunk_size_field() -> Field[Any]:
    from connector.connector_config import ConnectorConfig  # imports torch: read when needed only

    return config_field(ConnectorConfig, "chunk_size")


class _Shown:
    """Text argparse shows in a help through `%(name)s`, read when the help is shown: `str()`."""

    def __init__(self, text: Callable[[], str]) -> None:
        self._text = text

    def __str__(self) -> str:
        return self._text()


class FieldFlag(argparse.Action):
    """A flag that sets one dataclass field only when given: its value is None otherwise, so what
    the config file, the environment or the field's default says applies. Its help (the field's
    metadata `help`, else the `help` given here for a field declared without `opt`), the default
    its help shows (metadata `shown`, else the field's default) and the type its text parses as
    (the field's: int, float, else str) are read from the field `field()` returns only when the
    help is shown (argparse fills the help's `%(words)s` and `%(shown)s` in) or a value is parsed:
    a field's module may import torch (ConnectorConfig's does), and every parser is built at
    start-up, its usage shown on any error."""

    def __init__(self, option_strings: Sequence[str], dest: str, field: Callable[[], Field[Any]],
                 help: str | None = None, **kwargs: Any) -> None:
        self._field = field
        self.words = _Shown(lambda: help if help is not None else str(self._field().metadata["help"]))
        self.shown = _Shown(lambda: str(self._field().metadata.get("shown", field_default(self._field()))))
        super().__init__(option_strings, dest, default=None, help="%(words)s (default: %(shown)s)", **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        kind = _TYPES.get(str(self._field().type).split(" | ")[0], str)
        try:
            value = kind(values)
        except ValueError:
            raise argparse.ArgumentError(self, f"invalid {kind.__name__} value: {values!r}") from None
        setattr(namespace, self.dest, value)


def add_connector_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the connector flags to `parser` (one argument group)."""
    g = parser.add_argument_group("KV connector (offload and reuse KV across tiers)")
    g.add_argument("--kv-tier", action="append", default=[], metavar="URL",
                   help="a storage tier, repeatable, fastest first: device, cpu, disk:///path, "
                        "redis://host:port/db, kvtier://host:port (query options: ?budget=4GiB&codec=lz4)")
    g.add_argument("--chunk-size", action=FieldFlag, field=_chunk_size_field, metavar="N")
    g.add_argument("--kv-codec", default=None, metavar="NAME",
                   help="codec for every tier: raw, lz4 (exact) or int8, int4 (lossy)")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="connector YAML, kvtier's keys or an LMCache config (default: $KVTIER_CONFIG, "
                        "else $LMCACHE_CONFIG_FILE); --kv-tier replaces its tiers. See docs/configuration.md")
    from connector.extension import extensions

    for ext in extensions().values():
        if ext.add_flags is not None:
            ext.add_flags(parser)


def connector_from_args(args: argparse.Namespace) -> EngineConnector | None:
    """Returns the connector the flags describe (or the environment names), or None when
    neither gives a tier or config. Raises ValueError naming the bad flag or config key."""
    from connector.extension import extensions
    from engine.kv_connector import connector_env

    registry = extensions()
    asked: dict[str, Mapping[str, Any]] = {}  # per extension section: the keys its flags set
    for name, ext in registry.items():
        changes = ext.flag_changes(args) if ext.flag_changes is not None else None
        if changes is not None:
            asked[name] = changes
    if not args.kv_tier and not args.config and not asked and not connector_env():
        if args.chunk_size is not None or args.kv_codec is not None:
            raise ValueError("--chunk-size/--kv-codec need a --kv-tier or --config (or KVTIER_TIERS/KVTIER_CONFIG)")
        return None
    from connector.connector_config import ConnectorConfig, make_config
    from connector.engine_connector import EngineConnector
    from kvstore.codecs import CODEC_NAMES
    from kvstore.store_config import TierSpec

    if args.kv_codec is not None and args.kv_codec not in CODEC_NAMES:
        raise ValueError(f"--kv-codec: unknown codec {args.kv_codec!r}; choose one of {list(CODEC_NAMES)}")

    base = ConnectorConfig.load(args.config)  # also $KVTIER_CONFIG and KVTIER_* overrides
    if args.kv_tier:
        base.kvstore.tiers = [TierSpec.from_url(u, f"--kv-tier[{i}]") for i, u in enumerate(args.kv_tier)]
    if args.chunk_size is not None and args.chunk_size <= 0:
        raise ValueError(f"--chunk-size must be > 0, got {args.chunk_size}")
    import dataclasses

    for name, changes in asked.items():
        section: Any = base.extensions.get(name) or registry[name].parse(None)  # a dataclass, as parsed
        try:
            base.extensions[name] = dataclasses.replace(section, enabled=True, **changes).validate()
        except ValueError as exc:
            raise ValueError(f"--{name}: {exc}") from None
    return EngineConnector(make_config(base, chunk_size=args.chunk_size, codec=args.kv_codec))
