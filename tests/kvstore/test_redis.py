"""The redis tier on a private redis-server (and a 3-node cluster): corruption, TTL, outages, TLS options."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from harness.polling import wait_until
from kvstore import serde
from kvstore.backend import BackendError, leading_run
from kvstore.backends.redis_store import RedisBackend
from kvstore.registry import create_backend
from kvstore.storage_manager import StorageManager
from kvstore.store_config import TierSpec
from tests.fixtures.tiers import chunk, ckey


@pytest.mark.parametrize("codec", ["raw", "lz4", "int8"])
def test_corrupt_and_truncated_values_are_misses(redis_server, codec: str) -> None:
    tier = RedisBackend(redis_server.url, codec=codec)
    for i in range(4):
        tier.put(ckey(i), chunk(i))
    client = redis_server.client()
    value = client.get(ckey(0))
    pos = len(value) // 3
    client.setrange(ckey(0), pos, bytes([value[pos] ^ 0x01]))  # one flipped bit in the payload
    client.set(ckey(1), client.get(ckey(1))[:-100])  # truncated
    client.set(ckey(2), client.get(ckey(3)))  # another key's (valid) value: foreign
    assert tier.get(ckey(0)) is None
    assert tier.batched_get([ckey(1), ckey(2), ckey(3)])[:2] == [None, None]
    s = tier.stats()
    assert s.corrupt == 3 and s.hits == 1
    assert client.exists(ckey(0), ckey(1), ckey(2)) == 0  # bad values removed
    assert tier.get(ckey(3)) is not None


def test_values_received_in_many_pieces_are_checked_as_they_arrive(redis_server) -> None:
    tier = RedisBackend(redis_server.url)
    big = [chunk(i, tokens=2048) for i in range(3)]  # 1.5 MB each, pipelined one after another
    assert big[0].nbytes > 2 * serde.CHECK_PIECE
    tier.batched_put([(ckey(i), kv) for i, kv in enumerate(big)])
    client = redis_server.client()
    value = client.get(ckey(1))
    client.setrange(ckey(1), len(value) - 1, bytes([value[-1] ^ 0x80]))  # its last byte
    client.set(ckey(3), b"KVT")  # shorter than any header
    got = tier.batched_get([ckey(i) for i in range(4)])
    assert torch.equal(got[0], big[0]) and torch.equal(got[2], big[2])
    assert got[1] is None and got[3] is None
    assert tier.stats().corrupt == 2


def test_ttl_and_prefix_hits_in_one_round_trip(redis_server) -> None:
    tier = create_backend(TierSpec.from_url(f"{redis_server.url}?ttl_s=30&codec=lz4"))
    tier.batched_put([(ckey(i), chunk(i)) for i in range(5)])
    client = redis_server.client()
    assert 0 < client.pttl(ckey(0)) <= 30_000
    leading_run(tier.batched_contains([ckey(0)]))  # the serving pool connects (and introduces itself) once
    before = client.info("stats")["total_commands_processed"]
    assert leading_run(tier.batched_contains([ckey(0), ckey(1), ckey(2), ckey(7), ckey(3)])) == 3
    after = client.info("stats")["total_commands_processed"]
    assert after - before <= 5 + 1  # five pipelined GETRANGEs (+ the INFO itself); no per-key chatter beyond that


def test_connection_failure_is_a_backend_error(redis_server) -> None:
    tier = RedisBackend(redis_server.url)
    tier.put(ckey(0), chunk(0))
    redis_server.kill()
    for call in (lambda: tier.get(ckey(0)), lambda: tier.put(ckey(1), chunk(1)),
                 lambda: leading_run(tier.batched_contains([ckey(0)])), lambda: tier.batched_get([ckey(0)])):
        with pytest.raises(BackendError, match="redis tier"):
            call()
    redis_server.restart()
    assert tier.get(ckey(0)) is None  # the restarted server is empty; the client reconnects
    tier.put(ckey(0), chunk(0))
    assert torch.equal(tier.get(ckey(0)), chunk(0))


def test_batched_get_reads_replies_in_order(redis_server) -> None:
    tier = RedisBackend(redis_server.url)
    tier.batched_put([(ckey(i), chunk(i)) for i in range(0, 10, 2)])
    wanted = list(range(10))  # hits and misses interleaved
    got = tier.batched_get([ckey(i) for i in wanted])
    for i, kv in zip(wanted, got):
        assert (kv is None) if i % 2 else torch.equal(kv, chunk(i))
    redis_server.kill()
    with pytest.raises(BackendError, match="redis tier"):
        tier.batched_get([ckey(i) for i in wanted])
    tier.close()


def test_redis_killed_mid_workload_manager_recovers(redis_server, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.kvstore")
    tiers = [create_backend(TierSpec("cpu", budget=3 * chunk(0).numel() * 2)), RedisBackend(redis_server.url)]
    mgr = StorageManager(tiers, names=["cpu", "redis"], backoff_initial_s=0.05, backoff_max_s=0.2)
    errors: list[BaseException] = []
    stop = threading.Event()

    def workload(seed: int) -> None:
        i = seed
        try:
            while not stop.is_set():
                i = (i + 7) % 50
                mgr.batched_put([(ckey(i), chunk(i))])
                kv = mgr.fetch([ckey((i * 3) % 50)])[0][0]
                assert kv is None or torch.equal(kv, chunk((i * 3) % 50))
                mgr.batched_contains([ckey(j) for j in range(5)])
        except BaseException as exc:  # anything escaping the manager fails the test
            errors.append(exc)

    threads = [threading.Thread(target=workload, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    redis_server.kill()
    time.sleep(0.5)
    assert not mgr.stats()["redis"].healthy
    redis_server.restart()
    wait_until(lambda: mgr.stats()["redis"].healthy, 10.0, 0.05)
    stop.set()
    for t in threads:
        t.join()
    assert errors == []
    mgr.flush()
    s = mgr.stats()["redis"]
    assert s.healthy and s.errors > 0 and s.skipped > 0
    mgr.batched_put([(ckey(77), chunk(77))])
    mgr.flush()
    assert torch.equal(tiers[1].get(ckey(77)), chunk(77))  # writes reach redis again
    messages = [r.getMessage() for r in caplog.records]
    # one log line per outage and direction, not per call
    assert sum("redis: writes failing" in m for m in messages) == 1
    assert sum("redis: reads failing" in m for m in messages) == 1
    assert mgr.holds.total() == 0
    mgr.close()


def test_a_write_in_flight_is_never_evicted(redis_server) -> None:
    """A put that needs room cannot evict a key whose own put was admitted and has not yet
    been written: the eviction's DEL could run first, and the late SET would leave a value
    stored but no longer counted (the budget exceeded, found once under 4 racing threads)."""

    class HeldWrite(RedisBackend):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            self.held, self.release = threading.Event(), threading.Event()

        def _pipeline(self):
            if threading.current_thread().name == "held-put":
                self.held.set()
                self.release.wait(10)  # admitted and counted, not yet written
            return super()._pipeline()

    one = len(serde.encode(ckey(0), chunk(0)))
    tier = HeldWrite(redis_server.url, byte_budget=one + one // 2)  # room for one chunk
    late = threading.Thread(target=lambda: tier.put(ckey(0), chunk(0)), name="held-put")
    try:
        late.start()
        assert tier.held.wait(10)
        assert tier.put(ckey(1), chunk(1)) is False  # the only victim is in flight: refused
        tier.release.set()
        late.join(10)
        client = redis_server.client()
        stored = sum(client.strlen(k) for k in client.scan_iter("*"))
        assert stored == tier.stats().bytes_used == one
        assert tier.put(ckey(1), chunk(1)) is True  # written now: an ordinary victim again
        assert stored == sum(client.strlen(k) for k in client.scan_iter("*")) == tier.stats().bytes_used
    finally:
        tier.release.set()
        late.join(10)
        tier.close()


@pytest.mark.parametrize("codec", ["raw", "lz4"])
def test_cluster_round_trip(redis_cluster, codec: str) -> None:
    tier = create_backend(TierSpec(redis_cluster.url, codec=codec))
    keys = [ckey(i) for i in range(30)]
    tier.batched_put([(k, chunk(i)) for i, k in enumerate(keys)])
    sizes = [node.client().dbsize() for node in redis_cluster.nodes]
    assert sum(sizes) == 30 and all(n > 0 for n in sizes)  # spread over all three masters
    assert leading_run(tier.batched_contains(keys + [ckey(99)])) == 30
    got = tier.batched_get(keys[::-1])
    assert all(torch.equal(kv, chunk(29 - i)) for i, kv in enumerate(got))
    tier.clear()
    assert sum(node.client().dbsize() for node in redis_cluster.nodes) == 0
    tier.close()


def test_rediss_passes_tls_options(tmp_path: Path) -> None:
    # no TLS server here: check the client is built for TLS with the given options, without connecting
    ca = tmp_path / "ca.pem"
    ca.write_text("")
    tier = create_backend(
        TierSpec("rediss://127.0.0.1:1/0", options={"ssl_ca_certs": str(ca), "ssl_cert_reqs": "none"})
    )
    pool = tier.client.connection_pool
    assert pool.connection_class.__name__ == "SSLConnection"
    assert pool.connection_kwargs["ssl_ca_certs"] == str(ca)
    with pytest.raises(BackendError):
        tier.get(ckey(0))
