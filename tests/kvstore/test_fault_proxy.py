"""The fault proxy (tests/fixtures/fault_proxy.py) on a real redis-server: it forwards bytes
unchanged, finds commands in any split of the RESP stream, and runs its hook exactly between
a redis tier's lookup (GETRANGE) and its load (GET), before the GET reaches the server."""

from __future__ import annotations

import os
import threading

import pytest
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from harness.redis import RedisServer
from kvstore.backend import BackendError
from kvstore.backends.redis_store import RedisBackend
from tests.fixtures.fault_proxy import FaultProxy, RespCommandScanner
from tests.fixtures.tiers import chunk, ckey

SEGMENTS = [(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$10\r\n0123456789\r\n", "SET"),
            (b"PING\r\n", "PING"),  # an inline command
            (b"*4\r\n$8\r\nGETRANGE\r\n$1\r\nk\r\n$1\r\n0\r\n$2\r\n63\r\n", "GETRANGE"),
            (b"*2\r\n$3\r\nget\r\n$1\r\nk\r\n", "GET")]
STREAM = b"".join(seg for seg, _ in SEGMENTS)
COMMANDS = [(sum(len(seg) for seg, _ in SEGMENTS[:i]), name) for i, (_, name) in enumerate(SEGMENTS)]


def scan(pieces: list[bytes]) -> list[tuple[int, str]]:
    """Returns each command's stream offset and name, feeding `pieces` one by one."""
    scanner, out, pos = RespCommandScanner(), [], 0
    for piece in pieces:
        out += [(pos + offset, name) for offset, name in scanner.feed(piece)]
        pos += len(piece)
    return out


def test_the_scanner_finds_every_command_however_the_stream_is_split() -> None:
    assert scan([STREAM]) == COMMANDS
    assert scan([STREAM[i:i + 1] for i in range(len(STREAM))]) == COMMANDS
    for cut in range(1, len(STREAM)):
        assert scan([STREAM[:cut], STREAM[cut:]]) == COMMANDS


def test_the_scanner_skips_large_values_and_refuses_what_is_not_resp() -> None:
    big = os.urandom(3 << 20)
    get = b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"
    stream = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n%s\r\n%s" % (len(big), big, get)
    pieces = [stream[i:i + 65536] for i in range(0, len(stream), 65536)]
    assert scan(pieces) == [(0, "SET"), (len(stream) - len(get), "GET")]
    with pytest.raises(ValueError):
        list(RespCommandScanner().feed(b"*2\r\n+OK\r\n"))
    with pytest.raises(ValueError):
        list(RespCommandScanner().feed(b"*x\r\n"))


def test_unarmed_the_proxy_forwards_bytes_unchanged(redis_server: RedisServer) -> None:
    value = os.urandom(5 << 20)
    with FaultProxy(redis_server.port) as proxy:
        client = redis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=5)
        client.set("k", value)
        assert client.get("k") == value
        assert redis_server.client().get("k") == value
        client.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("fault-proxy")]


def test_armed_the_hook_runs_between_the_lookup_and_the_load(redis_server: RedisServer) -> None:
    keys = [ckey(i) for i in range(4)]
    with FaultProxy(redis_server.port) as proxy:
        tier = RedisBackend(proxy.url)
        try:
            assert tier.batched_put([(k, chunk(i)) for i, k in enumerate(keys)]) == [True] * 4
            alive_at_hook: list[bool] = []

            def kill() -> None:
                alive_at_hook.append(redis_server.alive())
                redis_server.kill()

            proxy.arm(["GET", "MGET"], kill)
            assert tier.batched_contains(keys) == [True] * 4  # the lookup passes: it reads no value
            assert not proxy.fired.is_set() and redis_server.alive()
            with pytest.raises(BackendError):
                tier.batched_get(keys)
            assert proxy.fired.wait(5) and proxy.hook_error is None  # set once the hook returned
            assert alive_at_hook == [True] and not redis_server.alive()
            seen = proxy.seen_before_fire()
            assert "GETRANGE" in seen and seen[-1] == "GET" and seen.count("GET") == 1

            redis_server.restart()  # the hook ran once: the proxy passes everything again
            assert tier.batched_put([(keys[0], chunk(0))]) == [True]
            got = tier.batched_get(keys[:1])[0]
            assert got is not None and torch.equal(got, chunk(0))
        finally:
            tier.close()


def test_an_unreachable_upstream_closes_the_client_connection(redis_server: RedisServer) -> None:
    redis_server.kill()
    with FaultProxy(redis_server.port, timeout=1.0) as proxy:
        client = redis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=2, retry=Retry(NoBackoff(), 0))
        with pytest.raises(redis.exceptions.ConnectionError):
            client.ping()
        client.close()
