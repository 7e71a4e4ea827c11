"""Operator pins on a real `kvtier cache-server` process (PIN/UNPIN/DESCRIBE, through the
`kvtier://` tier as `POST /kv/pin` uses it): a pinned entry is never evicted from memory nor
from the disk spill, the pin budget refuses a pin whole, pins survive a restart with the spill
directory and unpinning there is kept too; a tenant token pins only its own keys; the storage
manager pins, describes and unpins in the cache server tier by its kind, as `/kv/pin` does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.cache_server import CacheServerProcess
from kvkeys.tenants import tenant_prefix
from kvstore.backends.cache_server_tier import CacheServerBackend
from kvstore.backends.memory import CPUBackend
from kvstore.backends.server_client import CacheServerClient, ServerReplyError
from kvstore.cache_server.protocol import Status
from kvstore.pin_set import PinError
from kvstore.storage_manager import StorageManager
from tests.fixtures.tiers import chunk, ckey

TOKENS = 64  # a chunk of 96 KiB


def _pins(tier: CacheServerBackend) -> tuple[int, int]:
    s = tier.stats()
    assert s.can_pin and s.pin_budget is not None and s.pinned_bytes <= s.pin_budget
    return s.pinned_entries, s.pinned_bytes


def _flood(tier: CacheServerBackend, base: int) -> None:
    """Writes 48 chunks (4.5 MiB): more than the server's memory and disk spill hold."""
    for i in range(48):
        tier.put(ckey(base + i), chunk(base + i, tokens=TOKENS))


def test_pinned_entries_are_never_evicted_and_survive_a_restart(
        cache_server_factory: type[CacheServerProcess], tmp_path: Path) -> None:
    server = cache_server_factory("--max-bytes", "1MiB", "--disk", str(tmp_path / "spill"),
                                  "--max-disk-bytes", "2MiB", "--pin-budget", "256KiB")
    tier = CacheServerBackend("127.0.0.1", server.port)
    tier.batched_put([(ckey(i), chunk(i, tokens=TOKENS)) for i in range(3)])
    one = tier.pin([ckey(0)])
    assert one > chunk(0, tokens=TOKENS).nbytes and _pins(tier) == (1, one)
    with pytest.raises(PinError, match="not stored"):
        tier.pin([ckey(1), ckey(99)])  # all or none
    with pytest.raises(PinError, match="pin budget"):
        tier.pin([ckey(1), ckey(2)])  # 3 chunks pass 256 KiB
    assert _pins(tier) == (1, one)
    disk_hits = tier.client.stats()["disk_hits"]
    _flood(tier, 100)
    assert torch.equal(tier.get(ckey(0)), chunk(0, tokens=TOKENS))
    assert tier.client.stats()["disk_hits"] == disk_hits  # it was still in memory
    assert tier.batched_contains([ckey(1), ckey(2)]) == [False, False]  # unpinned: evicted, then dropped
    info = tier.describe([ckey(0), ckey(1)])
    assert info[0] is not None and info[0].pinned and info[0].pin_expires_in_s is None and info[1] is None
    tier.close()

    server.restart()  # SIGTERM: memory goes to the spill, the pins beside it
    tier = CacheServerBackend("127.0.0.1", server.port)
    assert _pins(tier)[0] == 1
    _flood(tier, 200)  # through memory and disk again: the pinned entry's file stays
    assert torch.equal(tier.get(ckey(0)), chunk(0, tokens=TOKENS))
    assert tier.unpin([ckey(0), ckey(1)]) == 1 and _pins(tier) == (0, 0)
    tier.close()

    server.restart()
    tier = CacheServerBackend("127.0.0.1", server.port)
    assert _pins(tier) == (0, 0)  # the unpin was kept
    _flood(tier, 300)
    assert tier.batched_contains([ckey(0)]) == [False]
    tier.close()


def test_removal_beats_a_pin_and_a_tenant_pins_only_its_own_keys(
        cache_server_factory: type[CacheServerProcess], tmp_path: Path) -> None:
    tokens = tmp_path / "tenants.json"
    tokens.write_text(json.dumps({"token-a": "0123456789abcdef"}))
    server = cache_server_factory("--auth-token", "op", "--tenant-tokens", str(tokens), "--max-bytes", "8MiB")
    op = CacheServerClient("127.0.0.1", server.port, auth_token="op")
    a = CacheServerClient("127.0.0.1", server.port, auth_token="token-a")
    mine, theirs = tenant_prefix("0123456789abcdef").encode() + b"k", b"kvtier:m0:other"
    assert a.put(mine, b"x" * 100) and op.put(theirs, b"y" * 100)
    assert a.pin([mine], ttl_s=3600) > 0
    with pytest.raises(ServerReplyError) as refused:
        a.pin([mine, theirs])
    assert refused.value.status == Status.FORBIDDEN
    with pytest.raises(ServerReplyError) as refused:
        a.unpin([theirs])
    assert refused.value.status == Status.FORBIDDEN
    assert op.pin([theirs]) > 0
    got = a.describe([mine])[0]
    assert got is not None and got["pinned"] and 0 < got["pin_expires_in_s"] <= 3600
    assert op.stats()["pin_entries"] == 2
    assert op.delete_prefix(tenant_prefix("0123456789abcdef").encode()) == 1  # forgetting a tenant beats its pins
    op.clear()  # and so does CLEAR
    s = op.stats()
    assert (s["pin_entries"], s["pin_bytes"]) == (0, 0)


def test_the_storage_manager_pins_in_the_cache_server_tier(cache_server_factory: type[CacheServerProcess]) -> None:
    server = cache_server_factory("--max-bytes", "8MiB")
    manager = StorageManager([CPUBackend(byte_budget=1 << 20), CacheServerBackend("127.0.0.1", server.port)],
                             names=["0:cpu", "1:kvtier"])
    manager.batched_put([(ckey(0), chunk(0))])
    manager.flush()
    ops = manager.operations
    tier = "kvtier"  # `tier: "kvtier"` in POST /kv/pin
    assert ops.index(tier) == 1 and ops.pin(tier, [ckey(0)], ttl_s=60) > 0
    info = ops.describe([ckey(0)])["1:kvtier"][0]
    assert info is not None and info.pinned and info.pin_expires_in_s is not None and info.pin_expires_in_s <= 60
    b = manager.stats()["1:kvtier"].backend
    assert b.can_pin and b.pinned_entries == 1 and b.pin_budget == 4 << 20
    with pytest.raises(PinError, match="not stored"):
        ops.pin(tier, [ckey(5)])
    assert ops.unpin(tier, [ckey(0)]) == 1
    b = manager.stats()["1:kvtier"].backend
    assert (b.pinned_entries, b.pinned_bytes) == (0, 0)
    manager.close()
