"""Operator pins in the tiers that evict (kvstore/pin_set.py): a pinned key survives a flood
that evicts everything else, a pin past the pin budget is refused whole, unpin and expiry
bring the counts back to zero, a removed key loses its pin; load pins still return to zero."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from kvkeys.keyspace import chunk_key
from kvstore.backend import StorageBackend
from kvstore.backends.disk import STATE_BYTES, DiskBackend
from kvstore.backends.memory import CPUBackend
from kvstore.pin_set import PinError, PinSet
from kvstore.storage_manager import StorageManager
from kvstore.store_config import TierSpec
from tests.fixtures.tiers import ckey

CHUNK = torch.ones(1, 2, 4, 1, 2)  # 64 bytes
N = CHUNK.nbytes


def tiers(tmp_path: Path) -> list[StorageBackend]:
    """A cpu tier and a disk tier, each room for 4 chunks (keys of 3 characters), pins for 2."""
    probe = DiskBackend(tmp_path / "probe")
    probe.put("k00", CHUNK)
    size = probe.stats().bytes_used - STATE_BYTES  # one file, headers included
    probe.close()
    return [CPUBackend(byte_budget=4 * N, pin_budget=2 * N),
            DiskBackend(tmp_path / "d", byte_budget=4 * size + STATE_BYTES, pin_budget=2 * size)]


@pytest.mark.parametrize("kind", [0, 1], ids=["cpu", "disk"])
def test_pinned_keys_survive_a_flood_unpinned_ones_do_not(tmp_path: Path, kind: int) -> None:
    tier = tiers(tmp_path)[kind]
    tier.batched_put([("a00", CHUNK), ("a01", CHUNK), ("c00", CHUNK)])
    assert tier.pin(["a00", "a01"]) > 0
    with pytest.raises(PinError, match="pin budget"):  # one more chunk does not fit: nothing pinned
        tier.pin(["c00"])
    s = tier.stats()
    assert s.can_pin and s.pinned_entries == 2 and s.pinned_bytes == s.pin_budget
    assert [i is not None and i.pinned for i in tier.describe(["a00", "a01", "c00"])] == [True, True, False]
    tier.batched_put([(f"f{i:02d}", CHUNK) for i in range(12)])
    assert tier.batched_contains(["a00", "a01", "c00", "f00", "f11"]) == [True, True, False, False, True]
    assert tier.unpin(["a00", "a01", "c00"]) == 2
    assert (tier.stats().pinned_entries, tier.stats().pinned_bytes) == (0, 0)
    tier.batched_put([(f"g{i:02d}", CHUNK) for i in range(12)])
    assert tier.batched_contains(["a00", "a01"]) == [False, False]
    with pytest.raises(PinError, match="not stored here"):
        tier.pin(["a00"])
    tier.close()


@pytest.mark.parametrize("kind", [0, 1], ids=["cpu", "disk"])
def test_expiry_and_removal_release_pins(tmp_path: Path, kind: int) -> None:
    tier = tiers(tmp_path)[kind]
    tier.batched_put([("a00", CHUNK), ("b00", CHUNK)])
    tier.pin(["a00"], ttl_s=0.05)
    tier.pin(["b00"])
    info = tier.describe(["a00"])[0]
    assert info is not None and info.pinned and info.pin_expires_in_s is not None and info.pin_expires_in_s <= 0.05
    time.sleep(0.08)
    assert tier.stats().pinned_entries == 1
    tier.delete("b00")  # removal beats a pin, and frees its bytes
    assert (tier.stats().pinned_entries, tier.stats().pinned_bytes) == (0, 0)
    tier.close()


def test_pin_set_is_exact_and_all_or_nothing() -> None:
    now = [0.0]
    pins = PinSet(100, clock=lambda: now[0])
    pins.pin([("a", 40), ("b", 40)], ttl_s=5)
    with pytest.raises(PinError):
        pins.pin([("c", 10), ("d", 20)])  # 110 > 100: neither
    assert (len(pins), pins.bytes) == (2, 80)
    pins.pin([("a", 40)])  # a re-pin costs nothing more and makes `a` permanent
    pins.resize("b", 70)  # would pass the budget: the pin is released, never the budget
    assert (len(pins), pins.bytes, pins.holds("b")) == (1, 40, False)
    now[0] = 10.0
    assert pins.holds("a") and pins.unpin(["a", "zz"]) == 1 and pins.bytes == 0
    with pytest.raises(PinError, match="ttl_s"):
        pins.pin([("a", 1)], ttl_s=0)


def test_operator_pins_sit_beside_load_holds(tmp_path: Path) -> None:
    manager = StorageManager(tiers(tmp_path), names=["0:cpu", "1:disk"])
    ops = manager.operations
    manager.batched_put([(ckey(0), CHUNK)])
    manager.flush()
    assert ops.index("disk") == 1 and ops.index(None) == 0 and ops.name("cpu") == "0:cpu"
    with pytest.raises(ValueError, match="0:cpu, 1:disk"):
        ops.index("redis")
    ops.pin("cpu", [ckey(0)])
    ops.pin("1:disk", [ckey(0)], ttl_s=60)
    assert [kv is not None for kv, _ in manager.fetch([ckey(0)])] == [True]
    assert manager.holds.total() == 0  # the load's holds are back to zero; the operator's pins stay
    assert {n: s.backend.pinned_entries for n, s in manager.stats().items()} == {"0:cpu": 1, "1:disk": 1}
    assert ops.unpin("0:cpu", [ckey(0)]) == 1 and ops.unpin("disk", [ckey(0)]) == 1
    manager.close()


def test_pin_budget_is_checked_in_the_spec() -> None:
    assert TierSpec.from_url("cpu?budget=1GiB&pin_budget=256MiB").pin_budget == 256 << 20
    with pytest.raises(ValueError, match="pin_budget.*more than the tier's budget"):
        TierSpec.from_url("cpu?budget=1MiB&pin_budget=2MiB", "tiers[0]")
    with pytest.raises(ValueError, match="redis tier cannot pin"):
        TierSpec.from_url("redis://localhost:6379/0?pin_budget=1MiB")


@pytest.mark.parametrize("kind", [0, 1], ids=["cpu", "disk"])
def test_delete_idle_removes_what_was_not_used_and_keeps_pins(tmp_path: Path, kind: int) -> None:
    """Idle chunks go, pinned ones and the tier's own bookkeeping (not a chunk key) stay."""
    tier = [CPUBackend(), DiskBackend(tmp_path / "idle")][kind]  # room for the long keys' files
    old, pinned, new = (chunk_key("m", "float16", 4, bytes([i]) * 16) for i in range(3))
    book = "kvtier:index:families"  # a key families index: bookkeeping, not a chunk
    tier.batched_put([(old, CHUNK), (pinned, CHUNK), (book, CHUNK)])
    tier.pin([pinned])
    if isinstance(tier, DiskBackend):  # its last use is the file's mtime
        for key in (old, pinned, book):
            os.utime(tier._path(key), (time.time() - 60, time.time() - 60))
    else:
        time.sleep(0.06)
    tier.batched_put([(new, CHUNK)])
    assert tier.delete_idle(0.05 if kind == 0 else 30) == 1
    assert tier.batched_contains([old, pinned, new, book]) == [False, True, True, True]
    tier.close()


def test_a_pin_set_round_trips_through_json_and_refuses_what_is_not_one() -> None:
    now = [1000.0]
    pins = PinSet(100, clock=lambda: now[0])
    pins.pin([("a", 40)], ttl_s=5)
    pins.pin([("b", 10), ("c", 20)])
    copy = PinSet(None, clock=lambda: now[0])
    copy.load_json(pins.to_json(), exists=lambda key: key != "c")  # c's value is gone
    assert (copy.budget, copy.bytes, copy.keys()) == (100, 50, ["a", "b"])
    info = copy.info("a")
    assert info is not None and info.expires_in_s == 5
    now[0] = 1005.0
    assert copy.keys() == ["b"] and copy.bytes == 10  # expired on the shared clock
    for bad in (b"[]", b'{"kind": "kvtier-pins", "version": 1, "budget": 5, "pins": {"x": [6, null]}}',
                b'{"kind": "kvtier-pins", "version": 1, "budget": null, "pins": {"x": [true, null]}}'):
        with pytest.raises(ValueError):
            copy.load_json(bad)
        assert copy.keys() == ["b"]  # nothing changed
