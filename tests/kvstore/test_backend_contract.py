"""The chunk-store contract stays a handful of methods (docs/architecture.md, "Tiers and the
storage manager"): what a new backend must write is at most seven methods, anything more is a
capability a tier declares by type (kvstore/capabilities.py), and no tier answers for a
capability it lacks with a method that raises."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

from kvstore import capabilities
from kvstore.backend import BytesBackend, StorageBackend
from kvstore.schemes import TIER_SCHEMES

CONTRACT = {"batched_contains", "batched_get", "batched_put", "delete", "clear", "stats", "close"}
CONVENIENCES = {"contains", "get", "put"}  # the batched forms with one key, defined once
CAPABILITIES = [c for c in vars(capabilities).values()
                if inspect.isclass(c) and c.__module__ == capabilities.__name__ and inspect.isabstract(c)]
# A tier's own public extra, beyond the contract and its capabilities, with why it stays.
EXTRAS = {"RedisBackend": {"wipe_all_chunks"}}  # removes every client's chunks on a shared server


def _public(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if not n.startswith("_") and callable(v)}


def _tier_classes() -> list[type[StorageBackend]]:
    out = []
    for target in sorted(set(TIER_SCHEMES.values())):
        module, _, name = target.partition(":")
        out.append(getattr(importlib.import_module(module), name))
    return out


def test_the_contract_is_seven_methods_six_of_them_abstract() -> None:
    assert _public(StorageBackend) - CONVENIENCES == CONTRACT
    assert len(CONTRACT) <= 7
    assert StorageBackend.__abstractmethods__ == CONTRACT - {"close"}


def test_no_tier_overrides_a_convenience() -> None:
    for cls in _tier_classes():
        for klass in cls.__mro__:
            if klass is StorageBackend:
                break
            assert not (CONVENIENCES & set(vars(klass))), f"{klass.__name__} overrides a one-key convenience"


def test_every_public_method_of_a_tier_is_the_contract_or_a_capability_it_declares() -> None:
    assert {c.__name__ for c in CAPABILITIES} == {"RemoteTier", "EvictingTier", "ReadsInPlace", "OperatedTier",
                                                  "PrefixDeletable", "HandsOverEvictions"}
    for cls in _tier_classes():
        allowed = CONTRACT | CONVENIENCES | {"from_spec"} | EXTRAS.get(cls.__name__, set())
        for cap in CAPABILITIES:
            if issubclass(cls, cap):
                allowed |= _public(cap)
        public = {n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))}
        assert public <= allowed, f"{cls.__name__} has {sorted(public - allowed)} outside its contract and capabilities"


def test_no_backend_method_refuses_by_raising_not_implemented() -> None:
    """A capability a tier lacks is absent, not a method that raises NotImplementedError."""
    for cls in [StorageBackend, BytesBackend, *_tier_classes()]:
        source = Path(inspect.getfile(cls))
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                name = getattr(node.exc.func, "id", "")
                assert name != "NotImplementedError", f"{source.name}:{node.lineno} raises NotImplementedError"
