"""SET_BUDGET against a real `kvtier cache-server` process (issue #50, "Operating the cache"): the
operator lowers the memory budget at run time and STATS shows it met at once (least recently
used entries evicted, or spilled to disk), later PUTs never pass it; a lowered tenant quota
evicts only that tenant's oldest entries; a tenant token and a malformed change are refused and
change nothing; the `kvtier://` tier passes the change through `TierOperations.set_budget`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cache_server import CacheServerProcess
from kvkeys.tenants import tenant_prefix
from kvstore.backends.server_client import CacheServerClient, ServerReplyError
from kvstore.budget import BudgetError
from kvstore.cache_server.protocol import Status
from kvstore.storage_manager import StorageManager
from kvstore.store_config import KVStoreConfig, TierSpec
from tests.fixtures.cache_server import settled

OPERATOR, TOKEN_A = "operator-token", "token-of-tenant-a"
TAG_A = "0123456789abcdef"
VALUE = bytes(64 << 10)
KEYS = [b"kvtier:m:%03d" % i for i in range(60)]
ENTRY = len(KEYS[0]) + len(VALUE)  # what one entry counts in the memory budget


def _client(server: CacheServerProcess, token: str | None) -> CacheServerClient:
    return CacheServerClient("127.0.0.1", server.port, auth_token=token)


def test_the_operator_lowers_the_budget_and_quota_at_run_time(
        cache_server_factory: type[CacheServerProcess], tmp_path: Path) -> None:
    tokens = tmp_path / "tenants.json"
    tokens.write_text(json.dumps({TOKEN_A: TAG_A}))
    server = cache_server_factory("--auth-token", OPERATOR, "--tenant-tokens", str(tokens), "--max-bytes", "4MiB")
    op, a = _client(server, OPERATOR), _client(server, TOKEN_A)
    assert all(op.put_many([(k, VALUE) for k in KEYS[:40]]))

    # a tenant's token may not change the limits, nor may a malformed change: nothing changes
    with pytest.raises(ServerReplyError) as info:
        a.set_budget(max_bytes=1 << 20)
    assert info.value.status == Status.FORBIDDEN
    for bad in ({"max_bytes": 0}, {}):
        with pytest.raises(ServerReplyError) as info:
            op.set_budget(**bad)
        assert info.value.status == Status.BAD_REQUEST
    before = op.stats()
    assert before["max_bytes"] == 4 << 20 and before["entries"] == 40

    budget = 1 << 20
    after = op.set_budget(max_bytes=budget)  # the reply is STATS after the change
    kept = budget // ENTRY
    assert after["max_bytes"] == budget and after["bytes"] == kept * ENTRY <= budget
    assert after["reserved_bytes"] == after["pinned_bytes"] == after["spilling_bytes"] == 0
    assert op.exists_many(KEYS[:40]) == [False] * (40 - kept) + [True] * kept  # the oldest went
    for key in KEYS[40:]:
        assert op.put(key, VALUE)
        assert op.stats()["bytes"] <= budget

    # tenant A past a lowered quota loses its own oldest entries, nobody else's
    mine = [tenant_prefix(TAG_A).encode() + b"m:%d" % i for i in range(6)]
    assert all(a.put_many([(k, VALUE) for k in mine]))
    others = op.exists_many(KEYS)
    quota = 3 * (len(mine[0]) + len(VALUE))
    after = op.set_budget(tenant_quota=quota)
    assert after["tenant_quota"] == quota and after["tenant_evictions"] == 3
    assert a.exists_many(mine) == [False] * 3 + [True] * 3 and op.exists_many(KEYS) == others
    assert all(a.put_many([(mine[0], VALUE)])) and a.exists_many(mine) == [True, False, False, False, True, True]

    # the kvtier:// tier passes a change through; it has no pin budget
    config = KVStoreConfig(tiers=[TierSpec.from_url(f"{server.url}?auth_token={OPERATOR}")])
    with StorageManager.from_config(config) as manager:
        manager.operations.set_budget("kvtier", byte_budget=budget // 2)
        b = next(iter(manager.stats().values())).backend
        assert b.byte_budget == budget // 2 and 0 < b.bytes_used <= budget // 2
        with pytest.raises(BudgetError, match="pin budget is the server.s own"):
            manager.operations.set_budget("kvtier", pin_budget=1)
    tenant = KVStoreConfig(tiers=[TierSpec.from_url(f"{server.url}?auth_token={TOKEN_A}")])
    with StorageManager.from_config(tenant) as manager:
        with pytest.raises(BudgetError, match="operator"):
            manager.operations.set_budget("kvtier", byte_budget=budget)
    assert op.stats()["max_bytes"] == budget // 2
    for c in (op, a):
        c.close()


def test_a_lowered_budget_spills_at_once(cache_server_factory: type[CacheServerProcess], tmp_path: Path) -> None:
    server = cache_server_factory("--max-bytes", "4MiB", "--disk", str(tmp_path / "spill"),
                                  "--max-disk-bytes", "64MiB")
    op = _client(server, None)
    assert all(op.put_many([(k, VALUE) for k in KEYS[:30]]))
    budget = 512 << 10
    after = op.set_budget(max_bytes=budget)
    assert after["bytes"] <= budget and after["entries"] + after["disk_entries"] == 30
    stats = settled(op)  # the spill's writes done: the ledger is back within the budget
    assert stats["bytes"] + stats["reserved_bytes"] + stats["pinned_bytes"] <= budget
    assert op.get(KEYS[0]) == VALUE  # spilled, not lost: read back from disk, within the budget
    assert op.stats()["bytes"] <= budget
    op.close()
