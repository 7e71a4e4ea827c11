"""USAGE and DELETE_IDLE on a real `kvtier cache-server` process: the cache server is operated as
the cpu and disk tiers are (one `OperatedTier`): usage per (tenant, key family) over memory and
its disk spill, idle deletion that spares pinned chunks and keys naming no chunk, a tenant token
confined to its own prefix, and the storage manager's operations reaching it by kind."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from harness.cache_server import CacheServerProcess
from kvkeys.stored_keys import usage_group
from kvkeys.tenants import tenant_prefix
from kvstore.backends.cache_server_tier import CacheServerBackend
from kvstore.backends.memory import CPUBackend
from kvstore.backends.server_client import CacheServerClient, ServerReplyError
from kvstore.cache_server import protocol as P
from kvstore.cache_server.protocol import Status
from kvstore.storage_manager import StorageManager

TAG = "0123456789abcdef"
OPERATOR, TOKEN = "operator-token", "token-of-the-tenant"
BOOKKEEPING = b"kvtier:index:families"


def _key(i: int, tenant: str | None = None, model: str = "m") -> bytes:
    head = tenant_prefix(tenant) if tenant else "kvtier:"
    return f"{head}{model}:float16:v1:c16:{i:032x}".encode()


def test_usage_counts_chunks_in_memory_and_on_the_spill(cache_server_factory: type[CacheServerProcess],
                                                        tmp_path: Path) -> None:
    server = cache_server_factory("--max-bytes", "1MiB", "--disk", str(tmp_path / "spill"), "--max-disk-bytes", "8MiB")
    c = CacheServerClient("127.0.0.1", server.port)
    value = bytes(100_000)
    keys = [_key(i) for i in range(20)] + [_key(i, TAG) for i in range(3)] + [_key(0, model="other")]
    assert all(c.put_many([(k, value) for k in keys] + [(BOOKKEEPING, b"{}")]))
    assert c.stats()["disk_entries"] > 0  # 2.4 MB over a 1 MiB memory: most of it spilled
    usage = c.usage()
    assert {g: n for g, (n, _) in usage.items()} == {  # not BOOKKEEPING
        (None, "m:float16:v1:c16"): 20, (TAG, "m:float16:v1:c16"): 3, (None, "other:float16:v1:c16"): 1}
    # each entry's bytes: key and value in memory, its file on the spill (a small header more)
    assert all(n * (len(keys[0]) + len(value)) <= b <= n * (len(keys[0]) + len(value) + 64)
               for (n, b) in usage.values())
    assert c.usage(tenant_prefix(TAG).encode()) == {(TAG, "m:float16:v1:c16"): usage[(TAG, "m:float16:v1:c16")]}
    c.close()


def test_delete_idle_spares_pins_and_bookkeeping(cache_server_factory: type[CacheServerProcess],
                                                 tmp_path: Path) -> None:
    server = cache_server_factory("--max-bytes", "1MiB", "--disk", str(tmp_path / "spill"), "--max-disk-bytes", "8MiB")
    c = CacheServerClient("127.0.0.1", server.port)
    value = bytes(100_000)
    old = [_key(i) for i in range(15)]  # more than memory holds: some are on the spill
    assert all(c.put_many([(k, value) for k in old] + [(BOOKKEEPING, b"{}")]))
    assert c.pin([old[0]]) > 0
    time.sleep(0.3)
    fresh = [_key(100 + i) for i in range(2)]
    assert all(c.put_many([(k, value) for k in fresh]))
    assert c.delete_idle(0.2) == len(old) - 1  # the pinned one stays, and the fresh ones
    assert c.exists_many([*old, *fresh, BOOKKEEPING]) == [True] + [False] * (len(old) - 1) + [True, True, True]
    assert c.delete_idle(0.0) == 2 and c.exists_many([old[0], BOOKKEEPING]) == [True, True]
    c.close()


def test_a_tenant_token_asks_usage_under_its_prefix_only(cache_server_factory: type[CacheServerProcess],
                                                         tmp_path: Path) -> None:
    tokens = tmp_path / "tenants.json"
    tokens.write_text(json.dumps({TOKEN: TAG}))
    server = cache_server_factory("--auth-token", OPERATOR, "--tenant-tokens", str(tokens), "--max-bytes", "8MiB")
    op, tenant = (CacheServerClient("127.0.0.1", server.port, auth_token=t) for t in (OPERATOR, TOKEN))
    assert all(op.put_many([(_key(0), b"x"), (_key(1, TAG), b"y")]))
    assert tenant.usage(tenant_prefix(TAG).encode()) == {(TAG, "m:float16:v1:c16"): (1, len(_key(1, TAG)) + 1)}
    for call in (lambda: tenant.usage(), lambda: tenant.usage(b"kvtier:"), lambda: tenant.delete_idle(0.0)):
        with pytest.raises(ServerReplyError) as info:
            call()
        assert info.value.status == Status.FORBIDDEN
    assert op.exists_many([_key(0), _key(1, TAG)]) == [True, True]  # nothing removed
    op.close()
    tenant.close()


def test_usage_past_its_group_bound_is_refused_not_sent(cache_server: CacheServerProcess) -> None:
    c = CacheServerClient("127.0.0.1", cache_server.port)
    assert all(c.put_many([(_key(0, model=f"m{i}"), b"") for i in range(P.MAX_USAGE_GROUPS + 1)]))
    with pytest.raises(ServerReplyError) as info:
        c.usage()
    assert info.value.status == Status.TOO_LARGE and "per tenant prefix" in str(info.value)
    assert len(c.usage(b"kvtier:m1")) == 1 + 10 + 100 + 1000  # m1, m10-m19, m100-m199, m1000-m1999
    c.close()


def test_the_storage_manager_operates_the_cache_server_as_a_tier(cache_server: CacheServerProcess) -> None:
    from tests.fixtures.tiers import chunk, ckey

    tier = CacheServerBackend("127.0.0.1", cache_server.port)
    with StorageManager([CPUBackend(), tier], names=["0:cpu", "1:kvtier"]) as manager:
        manager.batched_put([(ckey(i), chunk(i)) for i in range(3)])
        manager.flush()
        ops = manager.operations
        usage = ops.usage()
        group = usage_group(ckey(0))
        assert usage["0:cpu"] == {group: (3, 3 * chunk(0).nbytes)}
        assert usage["1:kvtier"] is not None and usage["1:kvtier"][group][0] == 3
        removed, errors = ops.delete_idle(0.0)
        assert removed == {"0:cpu": 3, "1:kvtier": 3} and errors == {}
        assert ops.usage()["1:kvtier"] == {}
