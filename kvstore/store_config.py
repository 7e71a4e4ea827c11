"""kvstore configuration: one dataclass tree, loadable from YAML and `KVTIER_*` env vars
(docs/architecture.md, "Tiers and the storage manager").

YAML:
    tiers:
      - {url: cpu, budget: 4GiB}
      - {url: "disk:///var/cache/kvtier", budget: 50GiB, codec: lz4}
      - {url: "redis://localhost:6379/0", budget: 20GiB, options: {ttl_s: 3600}}

Environment (overrides YAML): KVTIER_CONFIG (path to the YAML, `kvsettings.ProcessEnv`) and one
`KVTIER_<KEY>` per key, declared in its field (`KVSTORE_SETTINGS`, listed in docs/configuration.md);
KVTIER_TIERS is comma-separated tier URLs whose query string carries budget/codec/eviction and options, e.g.
`cpu?budget=4GiB,redis://h:6379/0?codec=lz4&ttl_s=60`.
Every validation error is a ValueError that names the offending key (or file and line).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from kvsettings import (
    TIERS_ENV,
    ProcessEnv,
    Setting,
    did_you_mean,
    env_float,
    env_int,
    env_str,
    field_settings,
    opt,
    parse_env,
)
from kvstore.codecs import CODEC_NAMES
from kvstore.deadlines import BACKOFF_INITIAL_S, BACKOFF_MAX_S, FLUSH_TIMEOUT_S
from kvstore.eviction import DEFAULT_POLICY, POLICIES
from kvstore.health import BREAKER_FAILURES
from kvstore.schemes import TIER_SCHEMES
from kvstore.sizes import parse_size

QUEUE_FULL_POLICIES = ("drop_oldest", "drop_new")
PINNING_SCHEMES = ("cpu", "device", "disk")
"""The tiers that keep operator pins (`pin_budget`, `POST /kv/pin`)."""

FILLS = ("write", "demote")
"""How chunks reach a tier (`TierSpec.fill`): every chunk stored, or the tier above's evictions."""


@dataclass
class TierSpec:
    """One storage tier: where (URL), how much (byte budget, None = unbounded), how encoded.

    `tenant_quota` caps the bytes of each tenant (cache_salt) in this tier (None = no cap;
    kvstore/tenant_quota.py). `pin_budget` bounds the bytes the operator may pin in this tier
    (`POST /kv/pin`; None = half of `budget`; only tiers that pin take it: kvstore/pin_set.py).
    `fill` says how chunks reach the tier: "write" (every chunk stored is written to it, the
    slower tiers in the background) or "demote" (only what the tier above evicts: the storage
    manager's hierarchy, kvstore/storage_manager.py; the tier above must be cpu or device).
    `options` carries backend-specific settings (redis: ttl_s, socket_timeout_s, ssl_* ...;
    disk: fsync). Backends receive the whole spec through `StorageBackend.from_spec`.
    """

    url: str
    budget: int | None = None
    codec: str = "raw"
    eviction: str = DEFAULT_POLICY
    options: dict[str, Any] = field(default_factory=dict)
    tenant_quota: int | None = None
    pin_budget: int | None = None
    fill: str = "write"

    @property
    def scheme(self) -> str:
        """Returns the URL scheme ("cpu", "disk", "redis", ...); a bare word is its own scheme."""
        return tier_scheme(self.url)

    def validate(self, where: str = "tier") -> TierSpec:
        """Returns self after checking every field; raises ValueError naming `where.<field>`."""
        if not isinstance(self.url, str) or not self.url:
            raise ValueError(f"{where}.url: expected a non-empty URL string, got {self.url!r}")
        if self.scheme not in TIER_SCHEMES:
            raise ValueError(f"{where}.url: unknown tier scheme {self.scheme!r} in {self.url!r}; "
                             f"choose one of {sorted(TIER_SCHEMES)}")
        parts = urlsplit(self.url)
        if self.scheme == "disk" and not parts.path:
            raise ValueError(f"{where}.url: a disk tier needs a path, e.g. disk:///var/cache/kvtier")
        if self.scheme.startswith(("redis", "rediss", "kvtier")) and not parts.hostname:
            raise ValueError(f"{where}.url: {self.url!r} has no host")
        try:
            _ = parts.port  # urllib parses the port lazily: reading it validates it
        except ValueError:
            raise ValueError(f"{where}.url: bad port in {self.url!r}") from None
        self.budget = parse_size(self.budget, f"{where}.budget")
        self.tenant_quota = parse_size(self.tenant_quota, f"{where}.tenant_quota")
        self.pin_budget = parse_size(self.pin_budget, f"{where}.pin_budget")
        if self.pin_budget is not None:
            if self.scheme in ("kvtier", "kvtiers"):
                raise ValueError(f"{where}.pin_budget: a cache server's pin budget is the server's "
                                 "(kvtier cache-server --pin-budget), not a client's")
            if self.scheme not in PINNING_SCHEMES:
                raise ValueError(f"{where}.pin_budget: a {self.scheme} tier cannot pin chunks; "
                                 f"only {', '.join(PINNING_SCHEMES)} tiers take a pin_budget")
            if self.budget is not None and self.pin_budget > self.budget:
                raise ValueError(f"{where}.pin_budget: {self.pin_budget} bytes is more than the tier's "
                                 f"budget ({self.budget} bytes)")
        if self.codec not in CODEC_NAMES:
            raise ValueError(f"{where}.codec: unknown codec {self.codec!r}; choose one of {list(CODEC_NAMES)}")
        if self.eviction not in POLICIES:
            raise ValueError(f"{where}.eviction: unknown policy {self.eviction!r}; choose one of {sorted(POLICIES)}")
        if self.fill not in FILLS:
            raise ValueError(f"{where}.fill: unknown fill {self.fill!r}; choose one of {list(FILLS)}")
        if not isinstance(self.options, dict):
            raise ValueError(f"{where}.options: expected a mapping, got {type(self.options).__name__}")
        return self

    @classmethod
    def from_url(cls, url: str, where: str = "tier") -> TierSpec:
        """Returns a validated spec from `url?budget=..&codec=..&eviction=..&<option>=..`."""
        base, _, query = url.partition("?")
        kw: dict[str, Any] = {"url": base, "options": {}}
        for name, value in parse_qsl(query, keep_blank_values=True):
            if name in ("budget", "codec", "eviction", "tenant_quota", "pin_budget", "fill"):
                kw[name] = value
            else:
                kw["options"][name] = _scalar(value)
        return cls(**kw).validate(where)


def tier_scheme(url: str) -> str:
    """Returns the scheme of a tier URL; `cpu` and `cpu://` are both "cpu"."""
    return url.split("://", 1)[0].lower() if "://" in url else url.lower()


def _scalar(text: str) -> Any:
    """Returns `text` as int, float or bool when it reads as one (for query-string options)."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _env_tiers(var: str, text: str) -> list[TierSpec]:
    urls = [u.strip() for u in text.split(",") if u.strip()]
    if not urls:
        raise ValueError(f"{var}: expected comma-separated tier URLs, got {text!r}")
    return [TierSpec.from_url(u, f"{var}[{i}]") for i, u in enumerate(urls)]


def _default_tiers() -> list[TierSpec]:
    return [TierSpec(url="cpu", budget=4 * 2**30)]


@dataclass
class KVStoreConfig:
    """Everything the storage manager needs. Tiers are ordered fast to slow. Each key is declared
    once, in its field: its default, and in the metadata (`kvsettings.opt`) its meaning and its
    `KVTIER_*` variable (`env`, parsed by `parse`); `KVSTORE_SETTINGS` is read from these fields."""

    tiers: list[TierSpec] = field(default_factory=_default_tiers, metadata=opt(
        "storage tiers, fastest first: `cpu`, `device`, `disk:///path`, `redis://host:port/db`, "
        "`kvtier://host:port`; each with `budget`, `tenant_quota` (bytes per cache_salt), `pin_budget` "
        "(cpu, device, disk: bytes the operator may pin; default half the budget), `codec` "
        "(raw, lz4, int8, int4), `eviction` (" + ", ".join(POLICIES) + "), `fill` (write: every chunk; "
        "demote: what the cpu or device tier above evicts) and backend options "
        "(env: comma-separated URLs, `?budget=4GiB&codec=lz4`)",
        env=TIERS_ENV, parse=_env_tiers, shown="cpu?budget=4GiB"))
    queue_size: int = field(default=64, metadata=opt(
        "background writes to the slower tiers that may wait; beyond it one is dropped (counted)",
        env="KVTIER_QUEUE_SIZE", parse=env_int))
    queue_full: str = field(default="drop_oldest", metadata=opt(
        "which write a full queue drops: drop_oldest or drop_new", env="KVTIER_QUEUE_FULL", parse=env_str))
    backoff_initial_s: float = field(default=BACKOFF_INITIAL_S, metadata=opt(
        "a failing tier's circuit breaker: cool-down before the first probe (seconds)",
        env="KVTIER_BACKOFF_INITIAL_S", parse=env_float))
    backoff_max_s: float = field(default=BACKOFF_MAX_S, metadata=opt(
        "longest cool-down between probes of a failing tier (seconds)", env="KVTIER_BACKOFF_MAX_S", parse=env_float))
    breaker_failures: int = field(default=BREAKER_FAILURES, metadata=opt(
        "consecutive failed calls (errors, or a remote tier's missed deadline) that open a tier's breaker",
        env="KVTIER_BREAKER_FAILURES", parse=env_int))
    flush_timeout_s: float = field(default=FLUSH_TIMEOUT_S, metadata=opt(
        "on shutdown, how long queued K/V stores may take; what is left is dropped (logged) (seconds)",
        env="KVTIER_FLUSH_TIMEOUT_S", parse=env_float))
    # shared secret: stored K/V carries a keyed MAC and unverified values are misses (kvstore.serde)
    integrity_key: str | None = field(default=None, repr=False, metadata=opt(
        "shared secret (>= 16 bytes): stored K/V carries a keyed MAC, unverified values are misses",
        env="KVTIER_INTEGRITY_KEY", parse=env_str, shown="unset", aliases=("KVTIER_KV_KEY",)))

    def validate(self) -> KVStoreConfig:
        """Returns self after checking every field; raises ValueError naming the key."""
        _check_type("queue_size", self.queue_size, int)
        if self.queue_size <= 0:
            raise ValueError(f"queue_size: must be > 0, got {self.queue_size}")
        if self.queue_full not in QUEUE_FULL_POLICIES:
            raise ValueError(f"queue_full: must be one of {list(QUEUE_FULL_POLICIES)}, got {self.queue_full!r}")
        for name in ("backoff_initial_s", "backoff_max_s", "flush_timeout_s"):
            value = getattr(self, name)
            _check_type(name, value, (int, float))
            if value <= 0:
                raise ValueError(f"{name}: must be > 0, got {value}")
        _check_type("breaker_failures", self.breaker_failures, int)
        if self.breaker_failures < 1:
            raise ValueError(f"breaker_failures: must be >= 1, got {self.breaker_failures}")
        if self.integrity_key is not None:
            _check_type("integrity_key", self.integrity_key, str)
            if len(self.integrity_key.encode()) < 16:
                raise ValueError("integrity_key: a shared secret needs at least 16 bytes "
                                 f"(got {len(self.integrity_key.encode())}); e.g. `openssl rand -hex 32`")
        if not isinstance(self.tiers, list) or not self.tiers:
            raise ValueError("tiers: expected a non-empty list of tiers")
        for i, tier in enumerate(self.tiers):
            if not isinstance(tier, TierSpec):
                raise ValueError(f"tiers[{i}]: expected a tier, got {type(tier).__name__}")
            tier.validate(f"tiers[{i}]")
        return self

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVStoreConfig:
        """Returns a validated config from a plain mapping (parsed YAML); unknown keys are errors."""
        if not isinstance(data, Mapping):
            raise ValueError(f"config: expected a mapping at the top level, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise unknown_key(key, known)
        kw = dict(data)
        if "tiers" in kw:
            kw["tiers"] = _tiers_from_data(kw["tiers"])
        return cls(**kw).validate()

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> KVStoreConfig:
        """Returns a validated config read from a YAML file."""
        return cls.from_dict(read_yaml(path))

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None,
             env: Mapping[str, str] | None = None) -> KVStoreConfig:
        """Returns the config from YAML (`path`, else $KVTIER_CONFIG, else defaults) with
        `KVTIER_*` environment overrides applied on top, validated."""
        env = os.environ if env is None else env
        path = path or ProcessEnv.read(env).config
        cfg = cls.from_yaml(path) if path else cls()
        return cls.from_dict({**dataclasses.asdict(cfg) | {"tiers": cfg.tiers}, **env_overrides(env)})


def read_yaml(path: str | os.PathLike[str]) -> Any:
    """Returns the parsed YAML file at `path` ({} when empty); raises a one-line ValueError
    naming the file (and the line and column of a syntax error)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f) or {}
    except OSError as exc:
        raise ValueError(f"config: cannot read {os.fspath(path)}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"config: {os.fspath(path)} is not UTF-8 text") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"config: {os.fspath(path)}{where}: YAML syntax error: {problem}") from None


def unknown_key(key: Any, known: Iterable[str], where: str = "") -> ValueError:
    """Returns the error for an unknown config key: names it, suggests a close match, lists
    every valid key."""
    known = sorted(known)
    return ValueError(f"{where}{key}: unknown config key{did_you_mean(key, known)}; valid keys: {', '.join(known)}")


KVSTORE_SETTINGS: tuple[Setting, ...] = field_settings(KVStoreConfig)
"""kvstore's keys, one row each, read from `KVStoreConfig`'s fields: the YAML key, its `KVTIER_*`
variable, default and meaning."""


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """Returns the kvstore keys set by `KVTIER_*` variables in `env`, parsed to their types;
    raises ValueError naming the variable whose value is malformed."""
    return parse_env(KVSTORE_SETTINGS, env)


def _tiers_from_data(items: Any) -> list[TierSpec]:
    if not isinstance(items, list):
        raise ValueError(f"tiers: expected a list, got {type(items).__name__}")
    known = {f.name for f in dataclasses.fields(TierSpec)}
    tiers = []
    for i, item in enumerate(items):
        if isinstance(item, TierSpec):
            tiers.append(item)
        elif isinstance(item, str):
            tiers.append(TierSpec.from_url(item, f"tiers[{i}]"))
        elif isinstance(item, Mapping):
            for key in item:
                if key not in known:
                    raise unknown_key(key, known, f"tiers[{i}].")
            if "url" not in item:
                raise ValueError(f"tiers[{i}].url: missing")
            tiers.append(TierSpec(**item))
        else:
            raise ValueError(f"tiers[{i}]: expected a URL or a mapping, got {type(item).__name__}")
    return tiers


def _check_type(key: str, value: Any, typ: type | tuple[type, ...]) -> None:
    # bool is an int subclass; a YAML `true` must not pass as a number
    if not isinstance(value, typ) or (isinstance(value, bool) and typ is not bool):
        names = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise ValueError(f"{key}: expected {names}, got {type(value).__name__} {value!r}")
