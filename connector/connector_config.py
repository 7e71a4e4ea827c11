"""Connector configuration: the kvstore config (tiers, codecs, the slower tiers' writer) plus
what the connector decides (chunk size, what is stored, its store queue, layerwise loads),
and one section per registered extension (connector/extension.py: `blend:`, CacheBlend's). One
YAML file holds them all, every key at the top level; errors are ValueErrors naming the key.

    chunk_size: 256                  # connector
    save_unfull_chunk: true          # connector
    max_pending_store_bytes: 1GiB    # connector
    tiers: [cpu, "disk:///var/cache/kvtier"]   # kvstore

An LMCache config (a mapping with LMCache's keys) is translated by `connector.lmcache_compat`.
Every key has a `KVTIER_*` variable (`all_settings()`, listed in docs/configuration.md).
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
from connector.extension import enabled_extension, extensions
from engine.kv_cache import KeyedModel
from engine.kv_connector import CONFIG_FILE_ENV
from kvkeys.keyspace import Keyspace
from kvkeys.tenants import set_tenant_tag_key, tag_key_bytes
from kvsettings import TENANT_TAG_KEY, Setting, env_bool, env_int, env_str, field_settings, merge, opt, parse_env
from kvstore.store_config import KVSTORE_SETTINGS, KVStoreConfig, TierSpec, parse_size, read_yaml, unknown_key

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("kvtier.connector")

PAGE_FORMS = ("auto", "tiles")
"""`cpu_page_form`: "auto" decodes the CPU pages vLLM's adapter reads (connector/vllm/layouts.py
`CPU_DECODED`) and moves the rest as tiles; "tiles" moves every ISA's pages as tiles."""


def valid_keys() -> frozenset[str]:
    """Returns every top-level key a kvtier config may have (kvstore's, the connector's and each
    registered extension's section)."""
    return frozenset({f.name for f in dataclasses.fields(KVStoreConfig)} | set(_CONNECTOR_KEYS) | set(extensions()))


def translate(data: Mapping[str, Any], source: str = "config") -> Mapping[str, Any]:
    """Returns `data` as a kvtier config: an LMCache config is mapped (connector.lmcache_compat),
    anything else is returned as it is."""
    if lmcache_compat.is_lmcache(data):
        return lmcache_compat.to_kvtier(data, source, valid_keys())
    return data


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}: expected int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{key}: must be > 0, got {value}")
    return value


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key}: expected bool, got {value!r}")
    return value


def _tag_key(key: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{key}: expected str, got {type(value).__name__}")  # never echo a secret
    tag_key_bytes(value)
    return value


def _page_form(key: str, value: Any) -> str:
    if value not in PAGE_FORMS:
        raise ValueError(f"{key}: expected one of {', '.join(PAGE_FORMS)}, got {value!r}")
    return str(value)


def _positive_size(key: str, value: Any) -> int:
    size = parse_size(value, key)
    if not size:
        raise ValueError(f"{key}: must be > 0")
    return size


@dataclass
class ConnectorConfig:
    """Everything an `EngineConnector` needs: the storage manager's own config in `kvstore`,
    and the rest. Each connector setting is declared once, in its field: its default, and in the
    metadata its meaning, its `KVTIER_*` variable (`env`, parsed by `parse`) and its `check`
    (`validate` runs them in field order); `CONNECTOR_SETTINGS` is read from these fields.

    `save_unfull_chunk` is safe here: loads never write blocks the engine's prefix cache owns
    (connector/planner.py, "the partial-chunk rule"). `store_queue_size` and
    `max_pending_store_bytes` bound the connector's store queue; kvstore's `queue_size` bounds
    a different queue, the storage manager's writer to the slower tiers.
    """

    kvstore: KVStoreConfig = field(default_factory=KVStoreConfig)
    chunk_size: int = field(default=256, metadata=opt(
        "tokens per stored chunk (the unit of reuse)", env="KVTIER_CHUNK_SIZE", parse=env_int, check=_positive_int))
    save_decode_tokens: bool = field(default=False, metadata=opt(
        "also store the K/V of generated tokens, so a follow-up turn reuses them",
        env="KVTIER_SAVE_DECODE_TOKENS", parse=env_bool, check=_bool))
    save_unfull_chunk: bool = field(default=True, metadata=opt(
        "also store a prompt's partial last chunk (so prompts shorter than a chunk are reused)",
        env="KVTIER_SAVE_UNFULL_CHUNK", parse=env_bool, check=_bool))
    max_pending_store_bytes: int = field(default=1 << 30, metadata=opt(
        "gathered K/V waiting to be stored; beyond it new stores are dropped (counted), never waited for",
        env="KVTIER_MAX_PENDING_STORE_BYTES", parse=env_str, check=_positive_size, shown="1GiB"))
    store_queue_size: int = field(default=64, metadata=opt(
        "store jobs (one per request and step) waiting for the connector's store thread; beyond it "
        "one is dropped (counted) as `queue_full` says",
        env="KVTIER_STORE_QUEUE_SIZE", parse=env_int, check=_positive_int))
    # Layer-pipelined loads: chunks stored one value per layer (kvkeys/keyspace.py).
    use_layerwise: bool = field(default=False, metadata=opt(
        "layer-pipelined loads: a hit is scheduled at once and layer i waits only for layer i "
        "(not with CacheBlend)",
        env="KVTIER_USE_LAYERWISE", parse=env_bool, check=_bool))
    reset_clears_shared_tiers: bool = field(default=False, metadata=opt(
        "vLLM's reset_prefix_cache(reset_connector=True) also clears the shared tiers (disk, Redis, "
        "the cache server: other instances' chunks too); by default only this process's cpu and device",
        env="KVTIER_RESET_CLEARS_SHARED_TIERS", parse=env_bool, check=_bool))
    cpu_page_form: str = field(default="auto", metadata=opt(
        "vLLM's CPU backend: 'auto' stores the pages of the kernels kvtier decodes (vec, vec16, amx in "
        "bfloat16) in the canonical form every vLLM CPU instance shares, and moves any other's (block, KV head) tiles "
        "as their bytes, keyed by their format; 'tiles' moves every kernel's pages as tiles",
        env="KVTIER_CPU_PAGE_FORM", parse=env_str, check=_page_form))
    # The operator's secret: tenant tags in stored keys are an HMAC of the salt (kvkeys/tenants.py),
    # declared once with the processes that read it without a connector (kvsettings.TENANT_TAG_KEY).
    tenant_tag_key: str | None = field(default=None, repr=False, metadata={**TENANT_TAG_KEY, "check": _tag_key})
    # Registered extensions' sections given, by section (`blend: {enabled: true, ratio: 0.15}` is
    # CacheBlend's): each as that extension's `parse` returns it (connector/extension.py).
    extensions: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> ConnectorConfig:
        """Returns self after checking every field; raises ValueError naming the key."""
        if not isinstance(self.kvstore, KVStoreConfig):
            raise ValueError(f"kvstore: expected a KVStoreConfig, got {type(self.kvstore).__name__}")
        self.kvstore.validate()
        for f in dataclasses.fields(self):
            if "check" in f.metadata:
                setattr(self, f.name, f.metadata["check"](f.name, getattr(self, f.name)))
        registry = extensions()
        for name, section in self.extensions.items():
            if name not in registry:
                raise ValueError(f"{name}: no extension of that name is installed "
                                 f"(installed: {', '.join(sorted(registry)) or 'none'})")
            section.validate()
        on = enabled_extension(self.extensions)
        if on is not None and self.use_layerwise and on[0].whole_chunks:
            raise ValueError(f"use_layerwise: {on[0].title} ({on[0].section}.enabled) loads whole chunks; "
                             "turn one of them off")
        return self

    def apply_tenant_tag_key(self) -> None:
        """Makes `tenant_tag_key` this process's tenant tag key (None: unkeyed tags), as the
        storage manager does with `integrity_key`: per process, so the last connector built decides."""
        set_tenant_tag_key(self.tenant_tag_key)

    def keyspace(self, model: KeyedModel, kv_dtype: torch.dtype | str, split_heads: bool = False,
                 token_multiple: int = 1) -> Keyspace:
        """Returns the keyspace this connector keys `model`'s chunks of `kv_dtype` in: whole
        chunks, per layer with `use_layerwise`, or per KV head (`split_heads`, covering all);
        spans a multiple of `token_multiple` tokens (pages moved as whole tiles)."""
        heads = (0, model.num_kv_heads) if split_heads else None
        return Keyspace(model.fingerprint, kv_dtype, self.chunk_size, model.num_layers,
                        layerwise=self.use_layerwise, heads=heads, token_multiple=token_multiple)

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
        registry = extensions()
        rest = {k: v for k, v in data.items() if k not in _CONNECTOR_KEYS and k not in registry}
        own = {k: data[k] for k in _CONNECTOR_KEYS if k in data}
        sections = {name: ext.parse(data[name]) for name, ext in registry.items() if name in data}
        return cls(kvstore=KVStoreConfig.from_dict(rest), extensions=sections, **own).validate()

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
        data = merge(data, parse_env(all_settings(), env))
        if overrides:
            if not isinstance(overrides, Mapping):
                raise ValueError(f"config: overrides must be a mapping, got {type(overrides).__name__}")
            data = merge(data, translate(overrides, "kv_connector_extra_config"))
        return cls.from_dict(data)


_CONNECTOR_KEYS = tuple(f.name for f in dataclasses.fields(ConnectorConfig) if f.name not in ("kvstore", "extensions"))
"""The connector's own top-level keys; extensions' sections and kvstore's keys are the rest."""
CONNECTOR_SETTINGS: tuple[Setting, ...] = field_settings(ConnectorConfig)


def all_settings() -> tuple[Setting, ...]:
    """Returns every config key, one row each: kvstore's, the connector's, then each registered
    extension's (CacheBlend's `blend.*`)."""
    return KVSTORE_SETTINGS + CONNECTOR_SETTINGS + tuple(s for ext in extensions().values() for s in ext.settings)


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
                                  extensions={k: dataclasses.replace(v) for k, v in source.extensions.items()})
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
