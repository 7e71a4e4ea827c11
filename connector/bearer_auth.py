"""The one check of an `Authorization` header against API keys, for every HTTP route that takes
them: `kvtier serve` and `kvtier router` (kvtier/server/http_edge.py, kvtier/server/tenant_auth.py)
and vLLM's `/kv/lookup` route (connector/vllm/lookup_route.py). Here, not in kvtier, because that
route runs inside vLLM's server and may not import kvtier; each caller answers a failure its own way.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence


def bearer_key(authorization: str, keys: Sequence[str]) -> int | None:
    """Returns the index in `keys` of the key the header value carries as `Bearer <key>`, else
    None. Every key is compared, each in constant time over SHA-256 digests, so the timing shows
    neither a key's length nor which key, if any, matched."""
    digest = hashlib.sha256(authorization.encode()).digest()
    found = None
    for i, key in enumerate(keys):
        if secrets.compare_digest(digest, hashlib.sha256(f"Bearer {key}".encode()).digest()):
            found = i
    return found
