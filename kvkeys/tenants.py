"""`cache_salt`: per-request cache isolation (vLLM's answer to CVE-2025-46570), and where a
stored key names its tenant.

A request's salt is mixed into the root its block chain starts from (vLLM mixes it into the
first block's hash: the same thing), so every block hash, and every chunk key the connector
derives the same way, differs from another salt's and from no salt's. Requests with one salt
share as before; requests without a salt share only with each other, and their hashes are
byte-identical to those before salts existed (stored chunks stay valid).

A salt is named in stored keys and in the engine's per-tenant bookkeeping only by its tag, a
hash of it, so the salt itself is never stored in clear. With a tag key (the operator's secret,
`set_tenant_tag_key`: the connector's `tenant_tag_key`, $KVTIER_TENANT_TAG_KEY) the tag is an
HMAC of the salt under it, so a reader of a shared tier cannot confirm a guessed salt; without
one it is the unkeyed hash it always was (stored keys stay valid).

A salted request's chunk keys (kvkeys/keyspace.py) start `kvtier:tenant-<tag>:`, so the tiers
can find, count and remove one tenant's entries without knowing the rest of the key; unsalted
keys (`kvtier:<model>:...`) carry no tenant and are unchanged.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from kvkeys.chain import HASH_BYTES

MAX_CACHE_SALT_LENGTH = 128
FORBIDDEN_CHARS = frozenset("@/\\\x00")
"""vLLM's rules (entrypoints/generate/base/protocol.py `validate_cache_salt`)."""

TAG_BYTES = 8
MIN_TAG_KEY_BYTES = 16
_TAG_CONTEXT = b"kvtier-tenant-tag\x00"  # domain separation: the key may serve elsewhere too
_tag_key: bytes | None = None


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


def tag_key_bytes(secret: str | bytes) -> bytes:
    """Returns `secret` as a tag key; ValueError unless it has at least 16 bytes."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(raw) < MIN_TAG_KEY_BYTES:
        raise ValueError(f"tenant_tag_key: a shared secret needs at least {MIN_TAG_KEY_BYTES} bytes "
                         f"(got {len(raw)}); e.g. `openssl rand -hex 32`")
    return raw


def set_tenant_tag_key(secret: str | bytes | None) -> None:
    """Sets (None: removes) this process's tenant tag key: from now on `tenant_tag` is keyed by
    it. Per process, like the K/V integrity key: every process sharing a tier must set the same
    key (or none), else a salt's entries are not found across them. ValueError for a key shorter
    than 16 bytes."""
    global _tag_key
    _tag_key = None if secret is None else tag_key_bytes(secret)


def tenant_tag_keyed() -> bool:
    """Returns whether this process's tenant tags are keyed (`set_tenant_tag_key`)."""
    return _tag_key is not None


def tenant_tag(cache_salt: str, secret: str | bytes | None = None) -> str:
    """Returns the 16 hex digits that name `cache_salt`'s entries (in stored keys, per-tenant
    quotas and figures), identical in every process with the same key: HMAC-SHA256 of the salt
    under `secret` (default: this process's tag key), truncated; with no key at all the unkeyed
    BLAKE2b hash tags have always been."""
    key = tag_key_bytes(secret) if secret is not None else _tag_key
    if key is None:
        return hashlib.blake2b(cache_salt.encode(), digest_size=TAG_BYTES, person=b"kvtier-tenant").hexdigest()
    return hmac.new(key, _TAG_CONTEXT + cache_salt.encode(), hashlib.sha256).digest()[:TAG_BYTES].hex()


def seal_root(root: bytes, tag: str) -> bytes:
    """Returns a salt's chain root (`salted_root`) as a shared tier's index of key families may
    keep it (connector/key_families.py; its own inverse): XORed with an HMAC of the tenant's tag
    under this process's tag key, so without the key it confirms no guessed salt; unchanged
    without a key (the unkeyed tag confirms a guess already)."""
    if _tag_key is None:
        return root
    mask = hmac.new(_tag_key, b"kvtier-root-seal\x00" + tag.encode(), hashlib.sha256).digest()
    return bytes(a ^ b for a, b in zip(root, mask))


# ---- where a stored key names its tenant --------------------------------------------
KEY_ROOT = "kvtier:"
TENANT_FIELD = "tenant-"
_TAG = re.compile(r"[0-9a-f]{16}")


def check_tag(tag: str) -> str:
    """Returns `tag`; ValueError unless it is 16 lowercase hex digits (a tenant tag)."""
    if not isinstance(tag, str) or not _TAG.fullmatch(tag):
        raise ValueError(f"a tenant tag is 16 lowercase hex digits, got {tag!r}")
    return tag


def tenant_prefix(tag: str) -> str:
    """Returns the prefix every stored key of tenant `tag` starts with."""
    return f"{KEY_ROOT}{TENANT_FIELD}{check_tag(tag)}:"


_START = len(KEY_ROOT) + len(TENANT_FIELD)


def key_tenant(key: str) -> str | None:
    """Returns the tenant tag a stored key names, or None for an unsalted key."""
    if not key.startswith(KEY_ROOT + TENANT_FIELD):
        return None
    tag = key[_START:_START + 16]
    return tag if key[_START + 16:_START + 17] == ":" else None


_BYTES_PREFIX = (KEY_ROOT + TENANT_FIELD).encode()


def key_tenant_bytes(key: bytes) -> str | None:
    """Returns the tenant tag a stored key in bytes names (the cache server's keys), or None."""
    if not key.startswith(_BYTES_PREFIX):
        return None
    try:
        return key_tenant(key[:_START + 17].decode("ascii"))
    except UnicodeDecodeError:
        return None
