"""The cache server's per-tenant tokens (`kvtier cache-server --tenant-tokens FILE`, read by
kvtier/cmd_cache_server.py): a token that binds its connection to one tenant's keys
(kvkeys/tenants.py), beside the operator's `--auth-token`, which may do anything.

Tokens are secrets: they are kept only as SHA-256 digests, and no error or log line names one.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from kvkeys.tenants import check_tag


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class TenantTokens:
    """Tenant tokens and the tag each binds to. Looked up by the token's SHA-256, so the time a
    lookup takes says nothing about how close a guess came."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        """`tokens`: token -> tenant tag; ValueError (naming no token) for an empty token or a
        malformed tag."""
        self._tags: dict[bytes, str] = {}
        for i, (token, tag) in enumerate(tokens.items()):
            if not isinstance(token, str) or not token:
                raise ValueError(f"tenant token {i}: must be a non-empty string")
            self._tags[_digest(token.encode())] = check_tag(tag)

    def __len__(self) -> int:
        return len(self._tags)

    def __repr__(self) -> str:
        return f"TenantTokens({len(self)} tokens)"  # never the tokens

    def tag(self, token: bytes) -> str | None:
        """Returns the tenant tag `token` binds to, or None if it is not a tenant token."""
        return self._tags.get(_digest(token))

    def holds(self, token: str) -> bool:
        """Returns whether `token` is one of the tenant tokens."""
        digest = _digest(token.encode())
        return any(hmac.compare_digest(d, digest) for d in self._tags)
