"""The redis tier under faults, on real redis-servers: a bad key costs one miss, a full server
keeps serving reads, a server that is back is used again within about a second, a frozen
(SIGSTOP) server stalls lookups only briefly, and clear() touches only this client's chunks."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from harness.polling import wait_until
from harness.redis import RedisServer
from kvstore.backends.memory import CPUBackend
from kvstore.backends.redis_store import RedisBackend
from kvstore.registry import create_backend
from kvstore.storage_manager import StorageManager
from kvstore.store_config import TierSpec
from tests.fixtures.tiers import chunk, ckey, longest_calls_while_frozen


def _poison(client, i: int, how: str) -> None:
    key = ckey(i)
    client.delete(key)
    if how == "list":
        client.rpush(key, b"not a chunk")
    elif how == "hash":
        client.hset(key, "f", "v")
    else:
        client.set(key, b"garbage that is long enough to be read as a header" * 4)


@pytest.mark.parametrize("where", ["single", "cluster"])
def test_a_key_that_is_not_a_chunk_is_one_miss_and_is_removed(where: str, request: pytest.FixtureRequest) -> None:
    server = request.getfixturevalue("redis_server" if where == "single" else "redis_cluster")
    tier = create_backend(TierSpec(server.url))
    mgr = StorageManager([tier], names=["redis"])
    keys = [ckey(i) for i in range(20)]
    mgr.batched_put([(k, chunk(i)) for i, k in enumerate(keys)])
    client = server.client() if where == "single" else tier.client
    for i, how in ((5, "list"), (9, "hash"), (13, "garbage")):
        _poison(client, i, how)

    assert mgr.tier_prefix_hits(keys) == {"redis": 5}  # stops at the bad key: EXISTS would have counted it
    assert mgr.batched_contains(keys) == [i not in (5, 9, 13) for i in range(20)]
    _poison(client, 5, "list")
    _poison(client, 9, "hash")
    got = [kv for kv, _ in mgr.fetch(keys)]
    for i, kv in enumerate(got):
        assert (kv is None) if i in (5, 9, 13) else torch.equal(kv, chunk(i))
    s = mgr.stats()["redis"]
    assert s.healthy and s.errors == 0 and s.hits == 17
    assert sum(client.exists(ckey(i)) for i in (5, 9, 13)) == 0  # removed, not counted again
    assert mgr.tier_prefix_hits(keys) == {"redis": 5}
    mgr.batched_put([(ckey(5), chunk(5))])  # the key is usable again
    assert torch.equal(mgr.fetch([ckey(5)])[0][0], chunk(5))
    tier.clear()
    mgr.close()


def test_a_full_redis_refusing_writes_keeps_serving_reads(own_redis: RedisServer) -> None:
    own_redis.client().config_set("maxmemory-policy", "noeviction")
    own_redis.client().config_set("maxmemory", "4mb")
    mgr = StorageManager([RedisBackend(own_redis.url)], names=["redis"])
    stored = []
    for i in range(200):  # fill until the server refuses (OOM under noeviction)
        mgr.batched_put([(ckey(i), chunk(i, tokens=64))])
        if not mgr.stats()["redis"].write_healthy:
            break
        stored.append(i)
    s = mgr.stats()["redis"]
    assert not s.write_healthy and "maxmemory" in s.last_error and stored
    for _ in range(3):  # reads go on, every one of them, while writes back off
        got = [kv for kv, _ in mgr.fetch([ckey(i) for i in stored])]
        assert all(torch.equal(kv, chunk(i, tokens=64)) for i, kv in zip(stored, got))
        assert all(mgr.batched_contains([ckey(i) for i in stored]))
    s = mgr.stats()["redis"]
    assert s.read_healthy and s.hits == 3 * len(stored)
    mgr.close()


def test_a_redis_that_is_back_is_used_again_within_about_a_second(own_redis: RedisServer) -> None:
    # default backoff: the old 0.5 s doubling to 30 s first retried ~3.4 s after a 4 s outage ended
    mgr = StorageManager([CPUBackend(), RedisBackend(own_redis.url)], names=["cpu", "redis"])
    stop = threading.Event()

    def writes() -> None:
        i = 0
        while not stop.is_set():
            mgr.batched_put([(ckey(i % 500), chunk(i % 500))])
            i += 1
            time.sleep(0.02)

    writer = threading.Thread(target=writes)
    writer.start()
    try:
        time.sleep(0.3)
        own_redis.kill()
        time.sleep(4.0)
        assert not mgr.stats()["redis"].write_healthy
        own_redis.restart()
        back = time.monotonic()
        wait_until(lambda: mgr.stats()["redis"].write_healthy, 10.0, 0.02)
        recovered_after = time.monotonic() - back
    finally:
        stop.set()
        writer.join()
    assert recovered_after < 2.0, f"writes resumed {recovered_after:.2f}s after the server was back"
    assert own_redis.client().dbsize() > 0
    mgr.close()


def test_a_frozen_redis_stalls_lookups_briefly_and_is_used_again_after(own_redis: RedisServer) -> None:
    tier = RedisBackend(own_redis.url)  # default timeouts: the serving path's is 0.5 s
    mgr = StorageManager([CPUBackend(), tier], names=["cpu", "redis"])
    keys = [ckey(i) for i in range(4)]
    tier.batched_put([(k, chunk(i)) for i, k in enumerate(keys)])
    calls = {"tier_prefix_hits": lambda: mgr.tier_prefix_hits(keys),
             "batched_contains": lambda: mgr.batched_contains(keys), "fetch": lambda: mgr.fetch(keys),
             "contains": lambda: mgr.batched_contains([keys[0]])}
    # the first calls time out; later ones are skipped by the backoff
    took = longest_calls_while_frozen(own_redis.proc.pid, calls)
    assert not mgr.stats()["redis"].read_healthy  # no call since it was resumed
    # the old 5 s socket timeout held each of these calls 5 s
    assert max(took.values()) < 2.0, took
    wait_until(lambda: mgr.tier_prefix_hits(keys)["redis"] == 4, 5.0, 0.05)
    assert mgr.tier_prefix_hits(keys)["redis"] == 4 and torch.equal(mgr.fetch(keys)[3][0], chunk(3))
    mgr.close()


def test_serving_timeout_is_configurable_and_options_are_checked(redis_server) -> None:
    tier = create_backend(TierSpec.from_url(f"{redis_server.url}?read_timeout_s=0.2&socket_timeout_s=3"))
    assert tier.reader.connection_pool.connection_kwargs["socket_timeout"] == 0.2
    assert tier.client.connection_pool.connection_kwargs["socket_timeout"] == 3
    with pytest.raises(ValueError, match="read_timeout"):
        create_backend(TierSpec.from_url(f"{redis_server.url}?read_timout_s=0.2"))


def test_clear_removes_only_this_clients_chunks(redis_server) -> None:
    a, b = RedisBackend(redis_server.url), RedisBackend(redis_server.url)
    a.batched_put([(ckey(i), chunk(i)) for i in range(3)])
    b.batched_put([(ckey(i), chunk(i)) for i in range(3, 6)])
    client = redis_server.client()
    client.set("unrelated", b"x")
    a.clear()
    assert [bool(client.exists(ckey(i))) for i in range(6)] == [False] * 3 + [True] * 3
    assert a.stats().entries == 0 and b.stats().entries == 3
    assert a.wipe_all_chunks() == 3  # the explicit, named operation removes everyone's chunks
    assert client.keys("kvtier:*") == [] and client.get("unrelated") == b"x"
    a.close()
    b.close()


def test_reading_stats_is_not_a_health_probe(own_redis: RedisServer) -> None:
    mgr = StorageManager([RedisBackend(own_redis.url)], names=["redis"], backoff_initial_s=0.05, backoff_max_s=0.05)
    own_redis.kill()
    assert mgr.fetch([ckey(0)])[0][0] is None and not mgr.stats()["redis"].read_healthy
    for _ in range(5):  # backoff elapsed each time: stats() used to be the probe, and always succeeded
        time.sleep(0.1)
        assert not mgr.stats()["redis"].read_healthy
    own_redis.restart()
    time.sleep(0.1)
    assert mgr.fetch([ckey(0)])[0][0] is None  # a call starts the probe (a PING on its own thread)
    wait_until(lambda: mgr.stats()["redis"].read_healthy, 10.0, 0.01)
    assert mgr.stats()["redis"].read_healthy
    mgr.close()
