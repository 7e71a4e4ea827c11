"""Connector configuration: the kvstore config (tiers, codecs, the slower tiers' writer) plus
what the connector decides (chunk size, what is stored, its store queue, layerwise loads,
CacheBlend). One YAML file holds both, every key at the top level; errors are ValueErrors
naming the key.

    chunk_size: 256                  # connector
    save_unfull_chunk: true          # connector
    max_pending_store_bytes: 1GiB    # connector
    tiers: [cpu, "disk:///var/cache/kvtier"]   # kvstore

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
from typing import TYPE_CHECKING, Any

from connector import lmcache_compat
from connector.blend.config import BLEND_SETTINGS, BlendConfig
from connector.keyspace import Keyspace
from engine.kv_connector import CONFIG_FILE_ENV
from kvstore.config import KVSTORE_SETTINGS, KVStoreConfig, TierSpec, parse_size, read_yaml, unknown_key
from kvstore.env import Setting, env_bool, env_int, env_str, merge, parse_env

if TYPE_CHECKING:
    import torch

    from engine.model_config import ModelConfig

_CONNECTOR_KEYS = ("chunk_size", "save_decode_tokens", "save_unfull_chunk", "max_pending_store_bytes",
                   "store_queue_size", "use_layerwise", "reset_clears_shared_tiers", "blend")

CONNECTOR_SETTINGS: tuple[Setting, ...] = (
    Setting("chunk_size", "KVTIER_CHUNK_SIZE", env_int, "256", "tokens per stored chunk (the unit of reuse)"),
    Setting("save_decode_tokens", "KVTIER_SAVE_DECODE_TOKENS", env_bool, "false",
            "also store the K/V of generated tokens, so a follow-up turn reuses them"),
    Setting("save_unfull_chunk", "KVTIER_SAVE_UNFULL_CHUNK", env_bool, "true",
            "also store a prompt's partial last chunk (so prompts shorter than a chunk are reused)"),
    Setting("max_pending_store_bytes", "KVTIER_MAX_PENDING_STORE_BYTES", env_str, "1GiB",
            "gathered K/V waiting to be stored; beyond it new stores are dropped (counted), never waited for"),
    Setting("store_queue_size", "KVTIER_STORE_QUEUE_SIZE", env_int, "64",
            "store jobs (one per request and step) waiting for the connector's store thread; beyond it "
            "one is dropped (counted) as `queue_full` says"),
    Setting("use_layerwise", "KVTIER_USE_LAYERWISE", env_bool, "false",
            "layer-pipelined loads: a hit is scheduled at once and layer i waits only for layer i "
            "(not with CacheBlend)"),
    Setting("reset_clears_shared_tiers", "KVTIER_RESET_CLEARS_SHARED_TIERS", env_bool, "false",
            "vLLM's reset_prefix_cache(reset_connector=True) also clears the shared tiers (disk, Redis, "
            "the cache server: other instances' chunks too); by default only this process's cpu and device"),
)
ALL_SETTINGS: tuple[Setting, ...] = KVSTORE_SETTINGS + CONNECTOR_SETTINGS + BLEND_SETTINGS
"""Every config key, one row each (kvstore's, the connector's, CacheBlend's)."""

logger = logging.getLogger("kvtier.connector")



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
    """Everything an `EngineConnector` needs: the storage manager's own config in `kvstore`,
    and the rest (one row each in `CONNECTOR_SETTINGS`, which says what each key means).

    `save_unfull_chunk` is safe here: loads never write blocks the engine's prefix cache owns
    (connector/planner.py, "the partial-chunk rule"). `store_queue_size` and
    `max_pending_store_bytes` bound the connector's store queue; kvstore's `queue_size` bounds
    a different queue, the storage manager's writer to the slower tiers.
    """

    kvstore: KVStoreConfig = field(default_factory=KVStoreConfig)
    chunk_size: int = 256
    save_decode_tokens: bool = False
    save_unfull_chunk: bool = True
    max_pending_store_bytes: int = 1 << 30
    store_queue_size: int = 64
    # Layer-pipelined loads: chunks stored one value per layer; a hit is scheduled at once and
    # its forward's layer i waits only for layer i (connector/keyspace.py).
    use_layerwise: bool = False
    # vLLM's connector reset: the shared tiers too (they hold what other instances stored).
    reset_clears_shared_tiers: bool = False
    # CacheBlend (`blend: {enabled: true, ratio: 0.15, check_layer: 1, ...}`, see BlendConfig).
    blend: BlendConfig = field(default_factory=BlendConfig)

    def validate(self) -> ConnectorConfig:
        """Returns self after checking every field; raises ValueError naming the key."""
        if not isinstance(self.kvstore, KVStoreConfig):
            raise ValueError(f"kvstore: expected a KVStoreConfig, got {type(self.kvstore).__name__}")
        self.kvstore.validate()
        for name in ("chunk_size", "store_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: expected int, got {value!r}")
            if value <= 0:
                raise ValueError(f"{name}: must be > 0, got {value}")
        if not isinstance(self.save_decode_tokens, bool):
            raise ValueError(f"save_decode_tokens: expected bool, got {self.save_decode_tokens!r}")
        if not isinstance(self.save_unfull_chunk, bool):
            raise ValueError(f"save_unfull_chunk: expected bool, got {self.save_unfull_chunk!r}")
        for name in ("use_layerwise", "reset_clears_shared_tiers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected bool, got {getattr(self, name)!r}")
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

    def keyspace(self, model: ModelConfig, kv_dtype: torch.dtype | str, split_heads: bool = False) -> Keyspace:
        """Returns the keyspace this connector keys `model`'s chunks of `kv_dtype` in: whole
        chunks, per layer with `use_layerwise`, or per KV head (`split_heads`, covering all)."""
        heads = (0, model.num_kv_heads) if split_heads else None
        return Keyspace(model.fingerprint, kv_dtype, self.chunk_size, model.num_layers,
                        layerwise=self.use_layerwise, heads=heads)

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
             env: Mapping[str, str] | None = None,
             overrides: Mapping[str, Any] | None = None) -> ConnectorConfig:
        """Returns the config from YAML (`path`, else $KVTIER_CONFIG, else $LMCACHE_CONFIG_FILE,
        else defaults; kvtier's or LMCache's keys) with every `KVTIER_*` variable in `env`
        applied on top, then `overrides` (a mapping of the same keys: vLLM's
        `kv_connector_extra_config`)."""
        env = os.environ if env is None else env
        unread = sorted(v for v in env if v.startswith("LMCACHE_") and v not in CONFIG_FILE_ENV)
        if unread:  # LMCache's env-only configuration: say so rather than ignore it silently
            logger.warning("%s not read by kvtier (only LMCACHE_CONFIG_FILE is); use the KVTIER_* variables, "
                           "see docs/configuration.md", ", ".join(unread))
        path = path or next((env[v] for v in CONFIG_FILE_ENV if env.get(v)), None)
        data: Any = {}
        if path:
            data = read_yaml(path)
            if not isinstance(data, Mapping):
                raise ValueError(f"config: {os.fspath(path)} must hold a mapping, got {type(data).__name__}")
            data = translate(data, os.fspath(path))
        data = merge(data, parse_env(ALL_SETTINGS, env))
        if overrides:
            if not isinstance(overrides, Mapping):
                raise ValueError(f"config: overrides must be a mapping, got {type(overrides).__name__}")
            data = merge(data, translate(overrides, "kv_connector_extra_config"))
        return cls.from_dict(data)


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
        cfg.chunk_size = chunk_size
    if save_decode_tokens is not None:
        cfg.save_decode_tokens = save_decode_tokens
    if codec is not None:
        for t in ks.tiers:
            t.codec = codec
    if save_unfull_chunk is not None:
        cfg.save_unfull_chunk = save_unfull_chunk
    if use_layerwise is not None:
        cfg.use_layerwise = use_layerwise
    return cfg.validate()
