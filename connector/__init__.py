"""connector: the bridge between the engine's paged kv_cache and kvstore chunks; CacheBlend."""
