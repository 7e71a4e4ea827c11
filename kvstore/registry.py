"""Tier construction by URL scheme (LMCache-style registry over `kvstore/schemes.py`).

Classes are imported lazily, so configuring only `cpu` never imports redis, and the cache
server's client tier is loaded only when a `kvtier://` (or TLS `kvtiers://`) URL is used.
"""

from __future__ import annotations

import importlib
from typing import Protocol

from kvstore.backend import StorageBackend
from kvstore.schemes import TIER_SCHEMES
from kvstore.store_config import TierSpec


class TierClass(Protocol):
    """A backend class as the registry builds it: one construction signature for every tier."""

    def from_spec(self, spec: TierSpec) -> StorageBackend:
        """Returns a backend built from one configured tier (URL, byte budget, codec, options)."""
        ...


def backend_class(scheme: str) -> TierClass:
    """Returns the backend class for `scheme`; raises ValueError for an unknown scheme."""
    try:
        target = TIER_SCHEMES[scheme.lower()]
    except KeyError:
        raise ValueError(f"unknown tier scheme {scheme!r}; choose one of {sorted(TIER_SCHEMES)}") from None
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def create_backend(spec: TierSpec) -> StorageBackend:
    """Returns a new backend for a validated tier spec."""
    spec.validate()
    return backend_class(spec.scheme).from_spec(spec)
