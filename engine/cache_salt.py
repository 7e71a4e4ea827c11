"""`cache_salt`: per-request cache isolation (vLLM's answer to CVE-2025-46570).

A request's salt is mixed into the root its block chain starts from (vLLM mixes it into the
first block's hash: the same thing), so every block hash, and every chunk key the connector
derives the same way, differs from another salt's and from no salt's. Requests with one salt
share as before; requests without a salt share only with each other, and their hashes are
byte-identical to those before salts existed (stored chunks stay valid).

A salt is named in stored keys and in the engine's per-tenant bookkeeping only by its tag, a
hash of it, so the salt itself is never stored in clear.
"""

from __future__ import annotations

import hashlib

from engine.hashing import HASH_BYTES

MAX_CACHE_SALT_LENGTH = 128
FORBIDDEN_CHARS = frozenset("@/\\\x00")
"""vLLM's rules (entrypoints/generate/base/protocol.py `validate_cache_salt`)."""

TAG_BYTES = 8


def validate_cache_salt(cache_salt: object) -> str | None:
    """Returns `cache_salt` (None: no salt); ValueError naming `cache_salt` unless it is a
    non-empty string of at most 128 characters without '@', '/', '\\' or NUL (vLLM's rules)."""
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError("cache_salt must be a non-empty string if provided")
    if len(cache_salt) > MAX_CACHE_SALT_LENGTH or any(c in FORBIDDEN_CHARS for c in cache_salt):
        raise ValueError(f"cache_salt must be at most {MAX_CACHE_SALT_LENGTH} characters and must not "
                         "contain '@', '/', '\\' or NUL")
    return cache_salt


def salted_root(root: bytes, cache_salt: str | None) -> bytes:
    """Returns the root a chain of `cache_salt`'s starts from: `root` itself without a salt,
    else a 16-byte hash of `root` and the salt (distinct per salt, never equal to `root`)."""
    if cache_salt is None:
        return root
    h = hashlib.blake2b(root, digest_size=HASH_BYTES, person=b"kvtier-salt")
    h.update(cache_salt.encode())
    return h.digest()


def tenant_tag(cache_salt: str) -> str:
    """Returns the 16 hex digits that name `cache_salt`'s entries (in stored keys, per-tenant
    quotas and figures): a hash of the salt, identical in every process."""
    return hashlib.blake2b(cache_salt.encode(), digest_size=TAG_BYTES, person=b"kvtier-tenant").hexdigest()
