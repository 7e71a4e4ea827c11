"""Where a stored key names its tenant: the one home of that part of the key format, so the
tiers can find, count and remove one tenant's entries without knowing the rest of the key.

A salted request's chunk keys (connector/keyspace.py) start `kvtier:tenant-<tag>:`, `<tag>`
being 16 hex digits derived from the salt (engine/cache_salt.py `tenant_tag`); the salt itself
is never stored. Unsalted keys (`kvtier:<model>:...`) carry no tenant and are unchanged.
"""

from __future__ import annotations

import re

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
