"""Tenants at the HTTP edge: which `cache_salt` a request runs under.

Without `--tenants` a request's salt is its body's `cache_salt` (vLLM's behaviour: the salt is
the client's secret). With `--tenants FILE` (and `--api-key`, the operator's key) every call
needs a key: the operator's key may name any salt; a tenant's key runs under its tenant's salt,
the body's `cache_salt` may repeat it and naming another is refused (403), so no client can
choose another tenant's salt. Admin calls (`/kv/forget_tenant`, `/kv/reset_prefix_cache`)
take the operator's key only.

The file is JSON or YAML, one API key -> cache salt per entry, or -> {cache_salt, name}: a
named tenant's hit, load and store figures in /metrics carry `tenant="<name>"`, other salts'
`tenant="other"` and unsalted requests' `tenant="none"` (a bounded label set; the salt, a
secret, is never a label):

    {"sk-alice-...": {"cache_salt": "tenant-alice", "name": "alice"}, "sk-bob-...": "tenant-bob"}
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, Request

from connector.bearer_auth import bearer_key
from kvkeys.tenants import validate_cache_salt
from kvstore.store_config import read_yaml
from kvtier.server.http_edge import unauthorized
from kvtier.server.openai_protocol import APIError


@dataclass(frozen=True)
class TenantKeys:
    """API keys and the cache salt each one forces (the operator's key forces none)."""

    api_key: str
    salts: dict[str, str]  # tenant API key -> its cache salt
    names: dict[str, str] = field(default_factory=dict)  # cache salt -> tenant name (its metrics label)

    @classmethod
    def load(cls, path: str | os.PathLike[str], api_key: str | None) -> TenantKeys:
        """Returns the file's keys; ValueError naming the file and entry at fault (no
        `api_key`, not a mapping, a key that is empty or the operator's, an invalid salt)."""
        name = os.fspath(path)
        if not api_key:
            raise ValueError("--tenants needs --api-key (the operator's key, for admin calls)")
        raw: Any = read_yaml(path)
        if not isinstance(raw, dict) or not raw:
            raise ValueError(f"--tenants {name}: expected a non-empty mapping of API key -> cache salt")
        salts: dict[str, str] = {}
        names: dict[str, str] = {}
        for i, (key, value) in enumerate(raw.items()):
            where = f"--tenants {name}: entry {i}"
            if not isinstance(key, str) or not key.strip():
                raise ValueError(f"{where}: the API key must be a non-empty string")
            if key == api_key:
                raise ValueError(f"{where}: a tenant key equals --api-key")
            salt, label = _entry(value, where)
            try:
                salts[key] = str(validate_cache_salt(salt if salt is not None else ""))
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            if label is not None:
                if names.get(salts[key], label) != label:
                    raise ValueError(f"{where}: its cache_salt already has the name {names[salts[key]]!r}")
                names[salts[key]] = label
        return cls(api_key, salts, names)

    def match(self, authorization: str) -> tuple[bool, str | None]:
        """Returns (whether the header carries a known key, the salt it forces: None for the
        operator's key). Every key is compared, in constant time each."""
        keys = [self.api_key, *self.salts]
        found = bearer_key(authorization, keys)
        if found is None:
            return False, None
        return True, (None if found == 0 else self.salts[keys[found]])


_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
RESERVED_NAMES = ("other", "none")
"""Labels of unnamed salts and unsalted requests in /metrics: no tenant may take them."""


def _entry(value: Any, where: str) -> tuple[Any, str | None]:
    """Returns (the salt, the tenant name or None) of one file entry: a salt, or a mapping with
    `cache_salt` and `name` (1-64 of A-Z a-z 0-9 _ . -, not "other" or "none")."""
    if not isinstance(value, dict):
        return value, None
    unknown = set(value) - {"cache_salt", "name"}
    if unknown or "cache_salt" not in value:
        raise ValueError(f"{where}: a mapping needs cache_salt (and optionally name), got keys {sorted(value)}")
    label = value.get("name")
    if label is not None and (not isinstance(label, str) or not _NAME.fullmatch(label) or label in RESERVED_NAMES):
        raise ValueError(f"{where}: name must be 1-64 of A-Z a-z 0-9 _ . - and not {' or '.join(RESERVED_NAMES)}, "
                         f"got {label!r}")
    return value["cache_salt"], label


class Tenancy:
    """The route dependencies and salt resolution of one server (tenants or none)."""

    def __init__(self, keys: TenantKeys | None, plain_auth: list[Any]) -> None:
        self.keys = keys
        self.user: list[Any] = [Depends(self._user)] if keys is not None else plain_auth
        self.admin: list[Any] = [Depends(self._admin)] if keys is not None else plain_auth

    async def _user(self, request: Request) -> None:
        assert self.keys is not None
        ok, salt = self.keys.match(request.headers.get("authorization", ""))
        if not ok:
            raise unauthorized()
        request.state.tenant_salt = salt

    async def _admin(self, request: Request) -> None:
        assert self.keys is not None
        ok, salt = self.keys.match(request.headers.get("authorization", ""))
        if not ok:
            raise unauthorized()
        if salt is not None:
            raise APIError(403, "this call needs the operator's API key (--api-key), not a tenant's",
                           "permission_error", code="forbidden")

    def is_tenant(self, request: Request) -> bool:
        """Returns whether `request` came with a tenant's key (not the operator's)."""
        return getattr(request.state, "tenant_salt", None) is not None

    def is_operator(self, request: Request) -> bool:
        """Returns whether `request` carries the operator's key on a server with tenants: the
        one caller that may learn of any tenant's entries (without `--tenants` every client
        shares one key, and a salt is the client's own secret)."""
        return self.keys is not None and getattr(request.state, "tenant_salt", None) is None

    def salt(self, request: Request, body_salt: str | None) -> str | None:
        """Returns the salt `request` runs under: its tenant's (the body may repeat it; naming
        another is a 403), else the body's `cache_salt` (already validated)."""
        forced = getattr(request.state, "tenant_salt", None)
        if forced is None:
            return body_salt
        if body_salt is not None and not secrets.compare_digest(body_salt.encode(), forced.encode()):
            raise APIError(403, "cache_salt: this API key's requests run under its own tenant's cache_salt; "
                           "omit cache_salt or send that one", "permission_error", "cache_salt", "forbidden")
        return forced
