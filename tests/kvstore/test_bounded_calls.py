"""Every remote call on the serving path is bounded, on real servers: a SIGSTOPped redis-server,
Redis Cluster node or cache server fails a lookup or a load at its deadline (a miss), the
tier's circuit breaker opens, calls are skipped while it is open, a probe off the caller's
thread closes it once the server is back, and hits return. The breaker's state machine, and a
shutdown whose disk never answers (its directory locked by another process) ending within its
flush bound."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from harness.cache_server import CacheServerProcess
from harness.polling import wait_until
from harness.redis import RedisServer, start_cluster
from kvstore.backend import BackendError
from kvstore.backends.disk import DiskBackend
from kvstore.backends.memory import CPUBackend
from kvstore.deadlines import RemoteDeadlines
from kvstore.health import BreakerState, CircuitBreaker
from kvstore.registry import create_backend
from kvstore.storage_manager import StorageManager
from kvstore.store_config import TierSpec
from tests.fixtures.tiers import chunk, ckey, hold_dir_lock

LOOKUP_S, LOAD_S = 0.3, 0.6
DEADLINES = f"lookup_timeout_s={LOOKUP_S}&load_timeout_s={LOAD_S}"
# What "within the deadline" allows on a shared, loaded machine; without deadlines these calls
# waited out 5 s (redis) or 10 s (the cache server's GETs) per call.
SLACK_S = 1.0


def test_breaker_opens_after_n_failures_and_one_caller_probes_after_the_cool_down() -> None:
    b = CircuitBreaker("t", backoff_initial_s=0.5, backoff_max_s=2.0, what="reads", failures=3)
    err = BackendError("down")
    for _ in range(2):
        assert b.available()
        b.failed(err)
    assert b.state is BreakerState.CLOSED and b.opens == 0  # below N
    b.succeeded(time.monotonic())
    for _ in range(3):  # N in a row, counted afresh after the success
        b.failed(err)
    assert b.state is BreakerState.OPEN and b.opens == 1 and not b.available()
    time.sleep(0.55)
    assert b.available() and b.state is BreakerState.HALF_OPEN  # this caller is the probe
    assert not b.available()  # the others skip while it probes
    b.failed(err)  # the probe failed: open again, with a doubled cool-down
    assert b.state is BreakerState.OPEN and b.opens == 1
    time.sleep(0.55)
    assert not b.available()  # 1 s now, not 0.5 s
    time.sleep(0.5)
    assert b.available()
    started = time.monotonic()
    b.succeeded(started)
    assert b.state is BreakerState.CLOSED and b.available() and b.opens == 1 and "down" in b.last_error


def test_a_breaker_with_a_probe_runs_it_off_the_callers_thread() -> None:
    outcomes = [BackendError("still down"), None]
    release = threading.Event()
    threads: list[str] = []

    def probe() -> None:
        threads.append(threading.current_thread().name)
        assert release.wait(10)
        out = outcomes.pop(0)
        if out is not None:
            raise out

    b = CircuitBreaker("t", backoff_initial_s=0.2, backoff_max_s=0.2, what="reads", probe=probe)
    b.failed(BackendError("down"))
    assert b.state is BreakerState.OPEN
    time.sleep(0.25)
    assert not b.available()  # the probe started; callers never wait for it
    assert b.state is BreakerState.HALF_OPEN
    release.set()
    assert wait_until(lambda: b.state is BreakerState.OPEN, 15.0, 0.02), "the probe never failed"
    time.sleep(0.25)
    assert not b.available()
    assert wait_until(lambda: b.state is BreakerState.CLOSED, 15.0, 0.02), "the second probe never succeeded"
    assert b.available() and len(threads) == 2 and threading.current_thread().name not in threads


def test_deadline_options_are_one_set_for_every_remote_tier() -> None:
    d = RemoteDeadlines.from_options({"read_timeout_s": 0.2, "load_timeout_s": 3}, "t",
                                     {"read_timeout_s": ("lookup_s", "load_s")})
    assert (d.lookup_s, d.load_s, d.write_s) == (0.2, 3.0, 5.0)  # the new name beats the older one
    assert d.connect_for("lookup") == 0.2 and d.connect_for("write") == 1.0
    for bad in (0, -1, "soon", float("inf"), True):
        with pytest.raises(ValueError, match="t: lookup_timeout_s must be"):
            RemoteDeadlines.from_options({"lookup_timeout_s": bad}, "t")


def _freeze_and_check(mgr: StorageManager, name: str, pid: int, keys: list[str], first: str) -> None:
    """Freezes `pid`, makes `first` call (a lookup or a load) and checks it failed within its
    deadline, opening the breaker; later calls are skipped; after SIGCONT the breaker closes
    and every chunk is read back whole."""
    calls: dict[str, Callable[[], object]] = {"lookup": lambda: mgr.batched_contains(keys),
                                              "load": lambda: [kv for kv, _ in mgr.fetch(keys)]}
    deadline = LOOKUP_S if first == "lookup" else LOAD_S
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        got = calls[first]()
        took = time.monotonic() - t0
        assert got in ([False] * len(keys), [None] * len(keys))  # a miss: the caller recomputes
        assert took < deadline + SLACK_S, f"the {first} took {took:.2f}s"
        s = mgr.stats()[name]
        assert s.read_breaker == BreakerState.OPEN and s.breaker_opens == 1 and s.timeouts == 1 and s.errors == 1
        skipped = s.skipped
        for call in calls.values():  # skipped while open: neither waits for the frozen server
            assert call() in ([False] * len(keys), [None] * len(keys))
        assert mgr.stats()[name].skipped == skipped + 2
        time.sleep(0.3)  # past the cool-down: a call starts a probe, which fails on its own thread
        calls["lookup"]()
        assert wait_until(lambda: mgr.stats()[name].read_breaker == BreakerState.OPEN, 15.0, 0.02), "not reopened"
        assert mgr.stats()[name].breaker_opens == 1  # reopened by the probe, not opened again
    finally:
        os.kill(pid, signal.SIGCONT)

    def closed() -> bool:  # each look that finds it open makes a lookup: one may start the probe that closes it
        if mgr.stats()[name].read_breaker == BreakerState.CLOSED:
            return True
        calls["lookup"]()
        return False

    assert wait_until(closed, 15.0, 0.02), "the breaker never closed"
    assert all(mgr.batched_contains(keys))
    assert all(torch.equal(kv, chunk(i)) for i, (kv, _) in enumerate(mgr.fetch(keys)))


@pytest.mark.parametrize("first", ["lookup", "load"])
def test_a_frozen_redis_misses_at_the_deadline_and_its_breaker_opens_then_closes(own_redis: RedisServer,
                                                                                  first: str) -> None:
    tier = create_backend(TierSpec.from_url(f"{own_redis.url}?{DEADLINES}"))
    mgr = StorageManager([CPUBackend(), tier], names=["cpu", "redis"], backoff_initial_s=0.2, backoff_max_s=0.2)
    keys = [ckey(i) for i in range(4)]
    tier.batched_put([(k, chunk(i)) for i, k in enumerate(keys)])
    _freeze_and_check(mgr, "redis", own_redis.proc.pid, keys, first)
    mgr.close()


@pytest.mark.parametrize("first", ["lookup", "load"])
def test_a_frozen_cache_server_misses_at_the_deadline_and_its_breaker_opens_then_closes(
        cache_server_factory: type[CacheServerProcess], first: str) -> None:
    server = cache_server_factory()
    tier = create_backend(TierSpec.from_url(f"{server.url}?{DEADLINES}"))
    mgr = StorageManager([CPUBackend(), tier], names=["cpu", "server"], backoff_initial_s=0.2, backoff_max_s=0.2)
    keys = [ckey(i) for i in range(4)]
    tier.batched_put([(k, chunk(i)) for i, k in enumerate(keys)])
    assert server.proc is not None
    _freeze_and_check(mgr, "server", server.proc.pid, keys, first)
    mgr.close()


def test_a_frozen_redis_cluster_node_misses_at_the_deadline() -> None:
    cluster = start_cluster(3)  # private: freezing a node of the session's cluster would disturb others
    try:
        tier = create_backend(TierSpec.from_url(f"{cluster.url}?{DEADLINES}"))
        mgr = StorageManager([CPUBackend(), tier], names=["cpu", "redis"], backoff_initial_s=0.2, backoff_max_s=0.2)
        keys = [ckey(i) for i in range(12)]  # across the three nodes' slots
        tier.batched_put([(k, chunk(i)) for i, k in enumerate(keys)])
        # well within --cluster-node-timeout (2 s): the other nodes do not fail it over meanwhile
        _freeze_and_check(mgr, "redis", cluster.nodes[1].proc.pid, keys, "lookup")
        mgr.close()
    finally:
        for node in cluster.nodes:
            if node.alive():
                os.kill(node.proc.pid, signal.SIGCONT)
        cluster.stop()


def test_a_disk_that_never_answers_cannot_hold_close(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The disk tier's directory is locked by another process (its writes wait on that flock
    forever): reads go on, and close() ends after its flush bound, dropping what is queued."""
    root = tmp_path / "disk"
    disk = DiskBackend(root)
    mgr = StorageManager([CPUBackend(), disk], names=["cpu", "disk"], queue_size=64, flush_timeout_s=0.5)
    mgr.batched_put([(ckey(100), chunk(100))])
    assert mgr.flush(30)
    with hold_dir_lock(root):
        mgr.batched_put([(ckey(i), chunk(i)) for i in range(3)])
        for i in range(3, 8):
            mgr.batched_put([(ckey(i), chunk(i))])
        # one stuck in the disk's lock, five queued
        assert wait_until(lambda: mgr.writer_stats()["pending"] == 6, 15.0, 0.02), mgr.writer_stats()
        assert not mgr.flush(0.2)
        assert disk.contains(ckey(100)) and torch.equal(disk.get(ckey(100)), chunk(100))  # reads go on
        assert disk.stats().entries == 1  # stats too (the directory's last figures)
        with caplog.at_level(logging.WARNING, logger="kvtier.kvstore"):
            t0 = time.monotonic()
            dropped = mgr.close()
            took = time.monotonic() - t0
    assert dropped == 5 and took < 0.5 + SLACK_S
    assert "5 queued write(s) to the slower tiers dropped, 1 still running abandoned" in caplog.text
