"""One LRU and byte budget: `ByteBudget` (kvstore/budget.py) with an `EvictionPolicy`
(kvstore/eviction.py) is the only eviction order under kvstore/, held by the cpu and disk tiers,
the cache server's memory (`ByteStore`) and its disk spill (`DiskSpill`); the server's memory
evicts by a selectable policy as a tier does."""

from __future__ import annotations

import ast
from collections import OrderedDict
from pathlib import Path

import pytest

from kvstore.budget import ByteBudget
from kvstore.cache_server.spill import DiskSpill
from kvstore.cache_server.store import ByteStore

KVSTORE = Path(__file__).resolve().parents[2] / "kvstore"

# Where an OrderedDict may be reordered. kvstore/tier_events.py keeps a bounded log of the keys
# each tier evicted last (to explain a miss), not an eviction order of stored entries.
ALLOWED = {"eviction.py", "tier_events.py"}


def _lru_calls(path: Path) -> list[str]:
    """Returns the `move_to_end(...)` and `popitem(last=False)` calls in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name = node.func.attr
        fifo_pop = name == "popitem" and any(
            kw.arg == "last" and isinstance(kw.value, ast.Constant) and kw.value.value is False
            for kw in node.keywords)
        if name == "move_to_end" or fifo_pop:
            found.append(f"{path.relative_to(KVSTORE.parent)}:{node.lineno}: {name}")
    return found


def test_no_eviction_order_outside_eviction_py() -> None:
    paths = sorted(KVSTORE.rglob("*.py"))
    assert any(p.parts[-2:] == ("cache_server", "store.py") for p in paths)  # the walk sees the server
    found = [call for p in paths if str(p.relative_to(KVSTORE)) not in ALLOWED for call in _lru_calls(p)]
    assert found == [], "an eviction order belongs in kvstore/eviction.py (a ByteBudget's policy)"
    assert _lru_calls(KVSTORE / "eviction.py")  # the check finds the real one


def test_server_memory_and_spill_each_hold_a_byte_budget(tmp_path: Path) -> None:
    spill = DiskSpill(tmp_path, max_bytes=10_000)
    try:
        store = ByteStore(max_bytes=1000, spill=spill)
        assert isinstance(store.budget, ByteBudget) and isinstance(spill.index, ByteBudget)
        for owner in (store, spill):
            assert not [name for name, v in vars(owner).items() if isinstance(v, OrderedDict)]
        store.put(b"k", bytes(10))
        assert b"k" in store.budget and store.budget.used == store.bytes_used == 11
        assert store.budget.tenants is store.tenants and spill.index.tenants is spill.tenants
    finally:
        spill.close()


@pytest.mark.parametrize(("eviction", "evicted"), [("lru", b"k1"), ("fifo", b"k0")])
def test_server_store_evicts_by_its_policy(eviction: str, evicted: bytes) -> None:
    store = ByteStore(max_bytes=3 * 102, eviction=eviction)
    for i in range(3):
        assert store.put(f"k{i}".encode(), bytes(100))
    assert store.get(b"k0") is not None  # lru: k0 is now the most recently read; fifo: no change
    assert store.put(b"k3", bytes(100))
    held = {k for k in (b"k0", b"k1", b"k2", b"k3") if store.contains(k)}
    assert held == {b"k0", b"k1", b"k2", b"k3"} - {evicted}
    assert store.evictions == 1 and store.budget.policy.name == eviction


def test_server_store_rejects_an_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy"):
        ByteStore(max_bytes=1000, eviction="random")


def test_pinned_entries_keep_their_place_and_are_never_evicted() -> None:
    store = ByteStore(max_bytes=4 * 102, pin_budget=102)
    for i in range(4):
        assert store.put(f"k{i}".encode(), bytes(100))
    store.pin_keys([b"k0"])
    assert store.put(b"k4", bytes(100))  # room from k1, the oldest not pinned
    assert store.contains(b"k0") and not store.contains(b"k1")
    assert list(store.budget.policy.order()) == [b"k0", b"k2", b"k3", b"k4"]
