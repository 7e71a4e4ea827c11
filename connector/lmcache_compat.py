"""LMCache configuration files, read as kvtier's: LMCache's keys mapped to kvtier's.

A mapping is read as LMCache's when it has a key that only LMCache has (`local_cpu`,
`max_local_cpu_size`, `remote_url`, `enable_blending`, ...; `chunk_size`,
`save_unfull_chunk` and `use_layerwise` mean the same in both). Such a file is translated whole: a kvtier-only key
in it (`tiers`, `blend`, ...) is an error, since which of the two should win would be a guess;
`KVTIER_*` variables still apply on top. Every key gets one of three treatments, listed in
`LMCACHE_KEYS` (which also renders the table in docs/configuration.md):

- map: becomes a kvtier key, with one INFO notice `lmcache <key> -> kvtier <key>`;
- ignore: tuning with no effect here, one WARNING naming it;
- unsupported: a feature kvtier lacks (P2P, PD disaggregation, a controller, GDS, ...); left
  at LMCache's default (or off) it is ignored with an INFO notice, otherwise a ValueError.

Omitted keys take LMCache's defaults where they shape the tiers (`local_cpu: true`,
`max_local_cpu_size: 5.0`), kvtier's elsewhere. LMCache sizes are GB of 1024**3 bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvsettings import did_you_mean
from kvstore.codecs import CODEC_NAMES
from kvstore.eviction import POLICIES

logger = logging.getLogger("kvtier.connector")

MAP, IGNORE, UNSUPPORTED = "map", "ignore", "unsupported"


@dataclass(frozen=True)
class LMCacheKey:
    """One LMCache key: how it is treated, what it becomes, and why (the docs table's row).
    `default` is LMCache's; an unsupported key holding it (or None/False/empty) is ignored."""

    name: str
    treatment: str
    kvtier: str
    note: str = ""
    default: Any = None


def _m(name: str, kvtier: str, note: str = "") -> LMCacheKey:
    return LMCacheKey(name, MAP, kvtier, note)


def _i(name: str, note: str) -> LMCacheKey:
    return LMCacheKey(name, IGNORE, "-", note)


def _u(name: str, note: str, default: Any = None) -> LMCacheKey:
    return LMCacheKey(name, UNSUPPORTED, "-", note, default)


_NO_PD = ("LMCache's NIXL prefill/decode transfer: use `kvtier serve --kv-role producer` and `consumer` over a shared "
          "redis:// or kvtier:// tier, behind `kvtier router --prefill URL --decode URL`")
_NO_P2P = "peer-to-peer K/V transfer: share K/V through a common redis:// or kvtier:// tier instead"
_NO_CTRL = "LMCache's controller has no kvtier counterpart"

LMCACHE_KEYS: tuple[LMCacheKey, ...] = (
    _m("chunk_size", "chunk_size"),
    _m("local_cpu", "tiers: a `cpu` tier (first unless local_device is cuda)", "default true, as in LMCache"),
    _m("max_local_cpu_size", "the `cpu` tier's budget", "GB (1024**3 bytes); default 5.0"),
    _m("local_device", "tiers: `cpu` or `device` (LMCache v0)", "cuda -> the `device` tier"),
    _m("max_local_cache_size", "the local_device tier's budget (LMCache v0)", "GB"),
    _m("local_disk", "tiers: `disk:///path`", "`file:///path` or a path"),
    _m("max_local_disk_size", "the disk tier's budget", "GB; required with local_disk"),
    _m("remote_url", "tiers: the last tier", "redis://, rediss://, kvtier:// (lm://, mooncakestore://... are errors)"),
    _m("remote_serde", "the remote tier's codec", "naive -> raw; or a kvtier codec (raw, lz4, int8, int4)"),
    _m("cache_policy", "every tier's eviction", "LRU -> lru, FIFO -> fifo"),
    _m("save_decode_cache", "save_decode_tokens"),
    _m("save_unfull_chunk", "save_unfull_chunk", "omitted: kvtier's default (true)"),
    _m("use_layerwise", "use_layerwise", "ignored (a warning) with enable_blending: kvtier's CacheBlend loads "
       "whole chunks"),
    _m("enable_blending", "blend.enabled"),
    _m("blend_recompute_ratios", "blend.ratio, then blend.narrowing", "one ratio per check layer"),
    _m("blend_check_layers", "blend.check_layer, then blend.narrowing", "one layer per ratio"),
    _m("blend_special_str", "blend.separator"),
    _i("enable_async_loading", "kvtier always loads in the background"),
    _i("blend_min_tokens", "kvtier blends segments of any length"),
    _i("lmcache_instance_id", "an LMCache controller name; kvtier has no instance registry"),
    _i("local_cpu_use_hugepages", "host memory tuning"),
    _i("reserve_local_cpu_size", "host memory tuning"),
    _i("local_disk_path_sharding", "kvtier shares one directory safely between processes"),
    _i("pipelined_backend", "LMCache v0 tuning"),
    _i("blocking_timeout_secs", "kvtier never blocks a step on a tier"),
    _i("lookup_timeout_ms", "kvtier's tiers have their own timeouts (tier options)"),
    _i("pre_caching_hash_algorithm", "kvtier's chunk keys are chained blake2b hashes"),
    _i("py_enable_gc", "process tuning"),
    _i("numa_mode", "process tuning"),
    _i("use_gds", "GPU Direct Storage is not used (gds_path is unsupported)"),
    _i("use_gpu_connector_v3", "LMCache-internal"),
    _i("enable_lazy_memory_allocator", "host memory tuning"),
    _i("pin_timeout_sec", "kvtier pins only while a load runs"),
    _i("pin_check_interval_sec", "kvtier pins only while a load runs"),
    _i("internal_api_server_enabled", "kvtier serve has its own HTTP API"),
    _i("enable_chunk_statistics", "see kvtier's per-tier metrics instead"),
    _u("enable_pd", _NO_PD, False),
    _u("pd_*", _NO_PD),
    _u("enable_p2p", _NO_P2P, False),
    _u("p2p_*", _NO_P2P),
    _u("enable_controller", _NO_CTRL, False),
    _u("controller_*", _NO_CTRL),
    _u("lmcache_worker_*", _NO_CTRL),
    _u("nixl_*", "NIXL transfer is not supported"),
    _u("transfer_channel", _NO_P2P),
    _u("gds_*", "GPU Direct Storage: use a disk:/// tier"),
    _u("maru_*", "CXL shared memory is not supported"),
    _u("blend_thresholds", "kvtier selects by ratio only (blend_recompute_ratios)"),
    _u("retrieve_locations", "kvtier reads from the fastest tier holding a chunk"),
    _u("store_location", "kvtier writes every tier"),
    _u("storage_plugins", "tiers are kvtier's registry schemes (kvstore.registry)"),
    _u("remote_storage_plugins", "tiers are kvtier's registry schemes (kvstore.registry)"),
    _u("runtime_plugin_locations", "no plugins"),
    _u("external_lookup_client", "lookups are local"),
    _u("extra_config", "backend extras of LMCache; set kvtier tier options in a kvtier YAML"),
    _u("min_retrieve_tokens", "kvtier loads any hit", 0),
    _u("enable_hidden_state_cache", "hidden states are not cached", False),
    _u("remote_config_url", "no remote configuration service"),
)
"""Every LMCache key kvtier knows, with its treatment (prefix rows end in `*`)."""

_BY_NAME = {k.name: k for k in LMCACHE_KEYS if not k.name.endswith("*")}
_PREFIXES = [k for k in LMCACHE_KEYS if k.name.endswith("*")]
SHARED_KEYS = frozenset({"chunk_size", "save_unfull_chunk", "use_layerwise"})  # same name and meaning in both


def lookup(name: str) -> LMCacheKey | None:
    """Returns the row for an LMCache key (exact, else by prefix), or None if kvtier does not know it."""
    row = _BY_NAME.get(name)
    if row is None:
        row = next((p for p in _PREFIXES if name.startswith(p.name[:-1])), None)
    return row


def is_lmcache(data: Mapping[str, Any]) -> bool:
    """Returns whether `data` is an LMCache config: it has a key only LMCache has."""
    return any(isinstance(k, str) and k not in SHARED_KEYS and lookup(k) is not None for k in data)


def _gb(value: Any, key: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{key}: expected a size in GB (a number >= 0), got {value!r}")
    return f"{float(value)}GiB"  # LMCache's GB are 1024**3 bytes


def _disk_url(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"local_disk: expected a path or file:///path, got {value!r}")
    path = value.strip()
    if path.startswith("file://"):
        path = path[len("file://"):]
    if not path.startswith("/"):
        raise ValueError(f"local_disk: expected an absolute path or file:///path, got {value!r}")
    return "disk://" + path


def _remote(url: Any) -> str:
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"remote_url: expected a URL like redis://host:6379, got {url!r}")
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("redis", "rediss", "kvtier", "kvtiers"):
        return url
    if scheme == "lm":
        raise ValueError(f"remote_url: {url!r} is LMCache's own server, which kvtier cannot talk to; run "
                         "`kvtier cache-server` and use kvtier://host:port, or use redis://host:port")
    raise ValueError(f"remote_url: the {scheme}:// remote has no kvtier tier; use redis://, rediss:// "
                     "or kvtier://host:port")


def _codec(value: Any) -> str:
    if value == "naive":
        return "raw"
    if value in CODEC_NAMES:
        return str(value)
    raise ValueError(f"remote_serde: {value!r} has no kvtier codec; use naive (raw), or one of "
                     f"{list(CODEC_NAMES)} (int8/int4 are lossy like CacheGen)")


def _int_list(value: Any, key: str) -> list[int]:
    items = value if isinstance(value, list) else [value]
    if not items or any(isinstance(v, bool) or not isinstance(v, int) for v in items):
        raise ValueError(f"{key}: expected a list of layer numbers, got {value!r}")
    return list(items)


def _float_list(value: Any, key: str) -> list[float]:
    items = value if isinstance(value, list) else [value]
    if not items or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in items):
        raise ValueError(f"{key}: expected a list of ratios, got {value!r}")
    return [float(v) for v in items]


def _note(lm_key: str, kvtier: str) -> None:
    logger.info("LMCache config: %s -> %s", lm_key, kvtier)


def to_kvtier(data: Mapping[str, Any], source: str = "config",
              kvtier_keys: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Returns the kvtier config mapping an LMCache config means; logs one notice per mapped
    or ignored key. Raises ValueError naming a key kvtier cannot honour, a kvtier-only key
    (`kvtier_keys`) mixed in, or an unknown key (listing every valid LMCache key)."""
    out: dict[str, Any] = {}
    blend: dict[str, Any] = {}
    lm_only = next((k for k in data if isinstance(k, str) and k not in SHARED_KEYS and lookup(k) is not None),
                   "its keys")
    for key, value in data.items():
        row = lookup(key) if isinstance(key, str) else None
        if row is None and key in kvtier_keys:
            raise ValueError(f"{key}: a kvtier key in an LMCache config ({source} is read as LMCache's because "
                             f"of {lm_only}); write the file with LMCache keys only or kvtier keys only "
                             f"(KVTIER_* variables apply on top of either)")
        if row is None:
            known = sorted(_BY_NAME) + [p.name for p in _PREFIXES]
            raise ValueError(f"{key}: not a kvtier key, nor an LMCache key kvtier knows{did_you_mean(key, known)} "
                             f"({source} is read as an LMCache config); valid LMCache keys: {', '.join(known)}")
        if row.treatment == IGNORE:
            logger.warning("LMCache config: %s has no effect in kvtier (%s); ignored", key, row.note)
        elif row.treatment == UNSUPPORTED:
            if value == row.default or value in (None, False, "", [], {}):
                logger.info("LMCache config: %s=%r ignored (off)", key, value)
            else:
                raise ValueError(f"{key}: LMCache's {key} has no kvtier meaning ({row.note})")
    for key in sorted(SHARED_KEYS):
        if key == "use_layerwise" and data.get("use_layerwise") and data.get("enable_blending"):
            logger.warning("LMCache config: use_layerwise ignored with enable_blending (kvtier's CacheBlend loads "
                           "whole chunks)")
        elif key in data:
            out[key] = data[key]
            _note(key, key)
    if "save_decode_cache" in data:
        out["save_decode_tokens"] = data["save_decode_cache"]
        _note("save_decode_cache", "save_decode_tokens")
    out["tiers"] = _tiers(data)
    if "enable_blending" in data:
        blend["enabled"] = data["enable_blending"]
        _note("enable_blending", "blend.enabled")
    layers = _int_list(data["blend_check_layers"], "blend_check_layers") if "blend_check_layers" in data \
        and data["blend_check_layers"] is not None else None
    ratios = _float_list(data["blend_recompute_ratios"], "blend_recompute_ratios") \
        if data.get("blend_recompute_ratios") is not None else None
    if (layers is None) != (ratios is None) and len(layers or ratios or []) > 1:
        raise ValueError("blend_check_layers/blend_recompute_ratios: several check layers need one ratio each; "
                         "give both lists")
    if layers is not None and ratios is not None and len(layers) != len(ratios):
        raise ValueError(f"blend_check_layers/blend_recompute_ratios: one ratio per layer is needed, got "
                         f"{len(layers)} layers and {len(ratios)} ratios")
    if layers is not None:
        blend["check_layer"] = layers[0]
        _note("blend_check_layers", "blend.check_layer" + (" + blend.narrowing" if len(layers) > 1 else ""))
    if ratios is not None:
        blend["ratio"] = ratios[0]
        _note("blend_recompute_ratios", "blend.ratio" + (" + blend.narrowing" if len(ratios) > 1 else ""))
    if layers is not None and ratios is not None and len(layers) > 1:
        blend["narrowing"] = [[lay, r] for lay, r in zip(layers[1:], ratios[1:])]
    if "blend_special_str" in data:
        blend["separator"] = data["blend_special_str"]
        _note("blend_special_str", "blend.separator")
    if blend:
        out["blend"] = blend
    return out


def _tiers(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Returns the tiers an LMCache config describes, fastest first (local memory, disk, remote)."""
    tiers: list[dict[str, Any]] = []
    device = data.get("local_device")
    if device is not None:
        if device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
            raise ValueError(f"local_device: expected cpu or cuda, got {device!r}")
        if str(device).startswith("cuda"):
            tier: dict[str, Any] = {"url": "device"}
            if data.get("max_local_cache_size") is not None:
                tier["budget"] = _gb(data["max_local_cache_size"], "max_local_cache_size")
            tiers.append(tier)
            _note("local_device", "tiers[0]: device" + (f"?budget={tier['budget']}" if "budget" in tier else ""))
    use_cpu = data.get("local_cpu", True)
    if not isinstance(use_cpu, bool):
        raise ValueError(f"local_cpu: expected true or false, got {use_cpu!r}")
    if device == "cpu":
        size = data.get("max_local_cache_size", data.get("max_local_cpu_size", 5.0))
        tiers.append({"url": "cpu", "budget": _gb(size, "max_local_cache_size")})
        _note("local_device", f"tiers[{len(tiers) - 1}]: cpu?budget={tiers[-1]['budget']}")
    elif use_cpu:
        tiers.append({"url": "cpu", "budget": _gb(data.get("max_local_cpu_size", 5.0), "max_local_cpu_size")})
        _note("local_cpu/max_local_cpu_size", f"tiers[{len(tiers) - 1}]: cpu?budget={tiers[-1]['budget']}")
    if data.get("local_disk"):
        size = data.get("max_local_disk_size", 0.0)
        if not size:
            raise ValueError("max_local_disk_size: local_disk needs a disk budget in GB (LMCache's default 0 "
                             "stores nothing)")
        tiers.append({"url": _disk_url(data["local_disk"]), "budget": _gb(size, "max_local_disk_size")})
        disk = tiers[-1]
        _note("local_disk/max_local_disk_size", f"tiers[{len(tiers) - 1}]: {disk['url']}?budget={disk['budget']}")
    if data.get("remote_url"):
        tier = {"url": _remote(data["remote_url"])}
        if data.get("remote_serde") is not None:
            tier["codec"] = _codec(data["remote_serde"])
            _note("remote_serde", f"tiers[{len(tiers)}].codec={tier['codec']}")
        tiers.append(tier)
        _note("remote_url", f"tiers[{len(tiers) - 1}]: {tier['url']}")
    if "cache_policy" in data:
        policy = str(data["cache_policy"]).lower()
        if policy not in POLICIES:
            raise ValueError(f"cache_policy: {data['cache_policy']!r} has no kvtier eviction policy; use "
                             f"{' or '.join(p.upper() for p in sorted(POLICIES))}")
        for tier in tiers:
            tier["eviction"] = policy
        _note("cache_policy", f"tiers[*].eviction={policy}")
    if not tiers:
        raise ValueError("local_cpu: the LMCache config leaves no tier (local_cpu false, no local_disk, no "
                         "remote_url)")
    return tiers
