"""Tier construction by URL scheme (LMCache-style registry).

Classes are imported lazily, so configuring only `cpu` never imports redis, and the cache
server's client tier is loaded only when a `kvtier://` (or TLS `kvtiers://`) URL is used.
"""

from __future__ import annotations

import importlib

from kvstore.backend import StorageBackend
from kvstore.config import TierSpec

# scheme -> "module:Class"; every class implements StorageBackend.from_spec(spec)
_REGISTRY: dict[str, str] = {
    "device": "kvstore.backends.memory:DeviceBackend",
    "cpu": "kvstore.backends.memory:CPUBackend",
    "disk": "kvstore.backends.disk:DiskBackend",
    "redis": "kvstore.backends.redis_store:RedisBackend",
    "rediss": "kvstore.backends.redis_store:RedisBackend",
    "redis+cluster": "kvstore.backends.redis_store:RedisBackend",
    "rediss+cluster": "kvstore.backends.redis_store:RedisBackend",
    "kvtier": "kvstore.backends.cache_server:CacheServerBackend",
    "kvtiers": "kvstore.backends.cache_server:CacheServerBackend",
}


def known_schemes() -> frozenset[str]:
    """Returns the URL schemes a tier may use."""
    return frozenset(_REGISTRY)


def register_backend(scheme: str, target: str) -> None:
    """Registers `target` ("module:Class") for URLs with `scheme` (replacing an earlier one)."""
    if ":" not in target:
        raise ValueError(f"backend target must look like 'module:Class', got {target!r}")
    _REGISTRY[scheme.lower()] = target


def backend_class(scheme: str) -> type[StorageBackend]:
    """Returns the backend class for `scheme`; raises ValueError for an unknown scheme."""
    try:
        target = _REGISTRY[scheme.lower()]
    except KeyError:
        raise ValueError(f"unknown tier scheme {scheme!r}; choose one of {sorted(_REGISTRY)}") from None
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def create_backend(spec: TierSpec) -> StorageBackend:
    """Returns a new backend for a validated tier spec."""
    spec.validate()
    return backend_class(spec.scheme).from_spec(spec)
