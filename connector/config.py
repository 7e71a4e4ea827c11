"""Connector configuration: the kvstore config (tiers, chunk size, decode saving) plus the few
knobs only the connector has. One YAML file holds both (connector keys at the top level next
to kvstore's); errors are ValueErrors naming the key.

    chunk_size: 256
    save_unfull_chunk: true          # connector
    max_pending_store_bytes: 1GiB    # connector
    tiers: [cpu, "disk:///var/cache/kvtier"]

An LMCache config (a mapping with LMCache's keys) is translated by `connector.lmcache_compat`.
Every key has a `KVTIER_*` variable (`ALL_SETTINGS`, listed in docs/configuration.md).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from connector import lmcache_compat
from connector.blend.config import BLEND_SETTINGS, BlendConfig
from kvstore.config import KVSTORE_SETTINGS, KVStoreConfig, TierSpec, parse_size, read_yaml, unknown_key
from kvstore.env import Setting, env_bool, env_str, merge, parse_env

_CONNECTOR_KEYS = ("save_unfull_chunk", "max_pending_store_bytes", "use_layerwise", "blend")

CONNECTOR_SETTINGS: tuple[Setting, ...] = (
    Setting("save_unfull_chunk", "KVTIER_SAVE_UNFULL_CHUNK", env_bool, "true",
            "also store a prompt's partial last chunk (so prompts shorter than a chunk are reused)"),
    Setting("max_pending_store_bytes", "KVTIER_MAX_PENDING_STORE_BYTES", env_str, "1GiB",
            "gathered K/V waiting to be stored; beyond it new stores are dropped (counted), never waited for"),
    Setting("use_layerwise", "KVTIER_USE_LAYERWISE", env_bool, "false",
            "layer-pipelined loads: a hit is scheduled at once and layer i waits only for layer i "
            "(not with CacheBlend)"),
)
ALL_SETTINGS: tuple[Setting, ...] = KVSTORE_SETTINGS + CONNECTOR_SETTINGS + BLEND_SETTINGS
"""Every config key, one row each (kvstore's, the connector's, CacheBlend's)."""

logger = logging.getLogger("kvtier.connector")

CONFIG_ENV = ("KVTIER_CONFIG", "LMCACHE_CONFIG_FILE")
"""Variables naming the config file, first one set wins (LMCache's name reads an LMCache YAML)."""


def valid_keys() -> frozenset[str]:
    """Returns every top-level key a kvtier config may have (kvstore's and the connector's)."""
    return frozenset({f.name for f in dataclasses.fields(KVStoreConfig)} | set(_CONNECTOR_KEYS))


def translate(data: Mapping[str, Any], source: str = "config") -> Mapping[str, Any]:
    """Returns `data` as a kvtier config: an LMCache config is mapped (connector.lmcache_compat),
    anything else is returned as it is."""
    if lmcache_compat.is_lmcache(data):
        return lmcache_compat.to_kvtier(data, source, valid_keys())
    return data


@dataclass
class ConnectorConfig:
    """Everything a `KVTierConnector` needs.

    `save_unfull_chunk`: also store a prompt's partial last chunk (safe here, see
    `kvtier_connector` module docstring). `max_pending_store_bytes`: gathered chunks waiting for
    the background store; beyond it new stores are dropped (counted), never waited for.
    """

    kvstore: KVStoreConfig = field(default_factory=KVStoreConfig)
    save_unfull_chunk: bool = True
    max_pending_store_bytes: int = 1 << 30
    # Layer-pipelined loads: chunks stored one value per layer; a hit is scheduled at once and
    # its forward's layer i waits only for layer i (connector/keyspace.py).
    use_layerwise: bool = False
    # CacheBlend (`blend: {enabled: true, ratio: 0.15, check_layer: 1, ...}`, see BlendConfig).
    blend: BlendConfig = field(default_factory=BlendConfig)

    @property
    def chunk_size(self) -> int:
        return self.kvstore.chunk_size

    @property
    def save_decode_tokens(self) -> bool:
        return self.kvstore.save_decode_tokens

    @property
    def store_queue_size(self) -> int:
        return self.kvstore.queue_size

    def validate(self) -> ConnectorConfig:
        """Returns self after checking every field; raises ValueError naming the key."""
        if not isinstance(self.kvstore, KVStoreConfig):
            raise ValueError(f"kvstore: expected a KVStoreConfig, got {type(self.kvstore).__name__}")
        self.kvstore.validate()
        if not isinstance(self.save_unfull_chunk, bool):
            raise ValueError(f"save_unfull_chunk: expected bool, got {self.save_unfull_chunk!r}")
        if not isinstance(self.use_layerwise, bool):
            raise ValueError(f"use_layerwise: expected bool, got {self.use_layerwise!r}")
        pending = parse_size(self.max_pending_store_bytes, "max_pending_store_bytes")
        if not pending:
            raise ValueError("max_pending_store_bytes: must be > 0")
        self.max_pending_store_bytes = pending
        if not isinstance(self.blend, BlendConfig):
            raise ValueError(f"blend: expected a BlendConfig, got {type(self.blend).__name__}")
        self.blend.validate()
        if self.use_layerwise and self.blend.enabled:
            raise ValueError("use_layerwise: CacheBlend (blend.enabled) loads whole chunks; turn one of them off")
        return self

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ConnectorConfig:
        """Returns a validated config from a mapping (kvstore keys + connector keys)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"config: expected a mapping at the top level, got {type(data).__name__}")
        data = translate(data)
        known = valid_keys()
        for key in data:
            if key not in known:
                raise unknown_key(key, known)
        rest = {k: v for k, v in data.items() if k not in _CONNECTOR_KEYS}
        own = {k: data[k] for k in _CONNECTOR_KEYS if k in data}
        if "blend" in own:
            own["blend"] = BlendConfig.from_dict(own["blend"])
        return cls(kvstore=KVStoreConfig.from_dict(rest), **own).validate()

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None,
             env: Mapping[str, str] | None = None) -> ConnectorConfig:
        """Returns the config from YAML (`path`, else $KVTIER_CONFIG, else $LMCACHE_CONFIG_FILE,
        else defaults; kvtier's or LMCache's keys) with every `KVTIER_*` variable in `env`
        applied on top."""
        env = os.environ if env is None else env
        unread = sorted(v for v in env if v.startswith("LMCACHE_") and v not in CONFIG_ENV)
        if unread:  # LMCache's env-only configuration: say so rather than ignore it silently
            logger.warning("%s not read by kvtier (only LMCACHE_CONFIG_FILE is); use the KVTIER_* variables, "
                           "see docs/configuration.md", ", ".join(unread))
        path = path or next((env[v] for v in CONFIG_ENV if env.get(v)), None)
        data: Any = {}
        if path:
            data = read_yaml(path)
            if not isinstance(data, Mapping):
                raise ValueError(f"config: {os.fspath(path)} must hold a mapping, got {type(data).__name__}")
            data = translate(data, os.fspath(path))
        return cls.from_dict(merge(data, parse_env(ALL_SETTINGS, env)))


def make_config(
    source: ConnectorConfig | KVStoreConfig | Mapping[str, Any] | str | os.PathLike[str]
    | Sequence[str | TierSpec] | bool | None = None,
    *,
    chunk_size: int | None = None,
    codec: str | None = None,
    save_decode_tokens: bool | None = None,
    save_unfull_chunk: bool | None = None,
    use_layerwise: bool | None = None,
) -> ConnectorConfig:
    """Returns a validated ConnectorConfig from any accepted form, overrides applied.

    `source`: a ConnectorConfig or KVStoreConfig; a mapping (parsed YAML, kvtier's or
    LMCache's keys); a YAML path; one tier URL; or a list of tier URLs / TierSpecs ordered
    fastest first; None = defaults; True = from the environment (`ConnectorConfig.load()`).
    `codec` replaces the codec of every tier.
    """
    if source is None:
        cfg = ConnectorConfig()
    elif source is True:
        cfg = ConnectorConfig.load()
    elif isinstance(source, ConnectorConfig):
        cfg = dataclasses.replace(source, kvstore=dataclasses.replace(source.kvstore),
                                  blend=dataclasses.replace(source.blend))
    elif isinstance(source, KVStoreConfig):
        cfg = ConnectorConfig(kvstore=dataclasses.replace(source))
    elif isinstance(source, Mapping):
        cfg = ConnectorConfig.from_dict(source)
    elif isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if text.endswith((".yaml", ".yml")) or Path(text).is_file():
            cfg = ConnectorConfig.load(text, env={})
        else:
            cfg = ConnectorConfig(kvstore=KVStoreConfig(tiers=[TierSpec.from_url(text, "tiers[0]")]))
    elif isinstance(source, Sequence):
        tiers = [t if isinstance(t, TierSpec) else TierSpec.from_url(str(t), f"tiers[{i}]")
                 for i, t in enumerate(source)]
        if not tiers:
            raise ValueError("tiers: at least one tier URL is needed")
        cfg = ConnectorConfig(kvstore=KVStoreConfig(tiers=tiers))
    else:
        raise ValueError(f"kv connector config: cannot use a {type(source).__name__}")
    ks = cfg.kvstore
    # Copy tier specs so overrides never mutate a caller's objects.
    ks.tiers = [dataclasses.replace(t, options=dict(t.options)) for t in ks.tiers]
    if chunk_size is not None:
        ks.chunk_size = chunk_size
    if save_decode_tokens is not None:
        ks.save_decode_tokens = save_decode_tokens
    if codec is not None:
        for t in ks.tiers:
            t.codec = codec
    if save_unfull_chunk is not None:
        cfg.save_unfull_chunk = save_unfull_chunk
    if use_layerwise is not None:
        cfg.use_layerwise = use_layerwise
    return cfg.validate()
