"""How a stored key reads, without torch (the cache server reads its keys the same way): the
family it belongs to (model, dtype, layout, chunk size), whether it names a chunk at all, and
the usage group an operator's figures count it under (its tenant and family). The keys are
written by kvkeys/keyspace.py (`chunk_key`, layer and head suffixes)."""

from __future__ import annotations

from kvkeys.tenants import KEY_ROOT, TENANT_FIELD, key_tenant

UsageGroup = tuple[str | None, str]
"""(tenant tag, or None for an unsalted key; key family): what a tier's usage is counted by."""


def key_family_label(key: str) -> str | None:
    """Returns `<model>:<dtype>:v<layout>:c<chunk_size>`, what a stored chunk key (any tenant's,
    any layer's or head's value) names besides its tenant and hash; None for another key."""
    if not key.startswith(KEY_ROOT):
        return None
    fields = key[len(KEY_ROOT):].split(":")
    if fields and fields[0].startswith(TENANT_FIELD):
        fields = fields[1:]
    if len(fields) != 5 or not fields[2].startswith("v") or not fields[3].startswith("c"):
        return None
    return ":".join(fields[:4])


def is_chunk_key(key: str) -> bool:
    """Returns whether `key` names a stored chunk's value (any tenant's, layer's or head's),
    not a tier's own bookkeeping (the key families' index, kvkeys/families.py)."""
    return key_family_label(key) is not None


def usage_group(key: str) -> UsageGroup | None:
    """Returns the (tenant, family) a chunk key is counted under; None for a key that names no
    chunk (never counted)."""
    family = key_family_label(key)
    return None if family is None else (key_tenant(key), family)


def usage_group_bytes(key: bytes) -> UsageGroup | None:
    """`usage_group` of a key in bytes (the cache server's keys); None for one that is not ASCII."""
    try:
        return usage_group(key.decode("ascii"))
    except UnicodeDecodeError:
        return None
