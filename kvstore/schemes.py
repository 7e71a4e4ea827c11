"""The tier URL schemes and the backend class each one builds ("module:Class", imported only
when a tier of that scheme is created, so configuring only `cpu` never imports redis).
Standard library only: the config validates schemes with it, the registry builds from it."""

from __future__ import annotations

TIER_SCHEMES: dict[str, str] = {
    "device": "kvstore.backends.memory:DeviceBackend",
    "cpu": "kvstore.backends.memory:CPUBackend",
    "disk": "kvstore.backends.disk:DiskBackend",
    "redis": "kvstore.backends.redis_store:RedisBackend",
    "rediss": "kvstore.backends.redis_store:RedisBackend",
    "redis+cluster": "kvstore.backends.redis_store:RedisBackend",
    "rediss+cluster": "kvstore.backends.redis_store:RedisBackend",
    "kvtier": "kvstore.backends.cache_server_tier:CacheServerBackend",
    "kvtiers": "kvstore.backends.cache_server_tier:CacheServerBackend",
}
"""scheme -> "module:Class"; every class has a `from_spec(spec)` classmethod (kvstore.registry.TierClass)."""
