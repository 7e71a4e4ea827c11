"""kvstore: codecs, storage tiers, the storage manager and the cache server (keys are opaque
strings here; the connector's keyspace builds them, kvkeys/keyspace.py).

Third-party imports: torch, numpy, redis, cramjam (LZ4), xxhash, blake3, sortedcontainers (the `reuse`
eviction policy's order) and PyYAML (only to read a YAML config); of kvtier's packages, `hostmem`, `kvkeys`
and `kvsettings`; never `engine` or `connector` (tests/test_import_rules.py, docs/architecture.md's table).
The cache server (`kvstore.cache_server`) never imports torch (tests/test_import_rules.py).
"""

from __future__ import annotations

import importlib
from typing import Any

# public names -> defining module; imported on first use so `kvstore.cache_server` stays torch-free
_EXPORTS = {
    "KVStoreConfig": "kvstore.store_config",
    "TierSpec": "kvstore.store_config",
    "StorageManager": "kvstore.storage_manager",
    "StorageBackend": "kvstore.backend",
    "BytesBackend": "kvstore.backend",
    "BackendError": "kvstore.backend",
    "create_backend": "kvstore.registry",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
