"""Per-server limits: --max-connections refuses in words, PREFIX_HITS carries a bounded
number of keys (no request runs unbounded work on the event loop)."""

from __future__ import annotations

import socket
import time

import pytest

from harness.cache_server import CacheServerProcess
from harness.polling import wait_until
from kvstore.backends.server_client import CacheServerClient, ServerReplyError
from kvstore.cache_server import protocol as P
from kvstore.cache_server.protocol import Op, Status
from tests.fixtures.cache_server import raw_exchange


def test_connections_past_the_limit_are_refused(cache_server_factory: type[CacheServerProcess]) -> None:
    server = cache_server_factory("--max-connections", "3")
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(3)]
    try:
        time.sleep(0.2)  # let the server accept them
        c = CacheServerClient("127.0.0.1", server.port)
        with pytest.raises(ServerReplyError, match=r"TOO_MANY_CONNECTIONS: too many connections \(limit 3\)") as info:
            c.ping()
        assert info.value.status == Status.TOO_MANY_CONNECTIONS
    finally:
        for s in idle:
            s.close()

    def served() -> bool:
        try:
            return bool(c.ping())
        except ServerReplyError:
            return False

    wait_until(served, 10.0, 0.05)  # served again once the idle ones leave
    stats = c.stats()
    assert stats["refused_connections"] >= 1 and stats["connections"] == 1
    c.close()


def test_prefix_hits_caps_keys_per_request(cache_server: CacheServerProcess) -> None:
    # The 16 MiB of empty keys (4M keys): refused after decoding 4096 of them.
    many = P.encode_key_list([b""] * (P.MAX_REQUEST_BODY // 4))
    data = raw_exchange(cache_server.port, P.encode_frame(Op.PREFIX_HITS, 1, payload=many) + P.encode_frame(Op.PING, 2))
    first = P.decode_header(data, 1 << 20)
    assert (first.code, first.request_id) == (Status.BAD_REQUEST, 1)
    assert b"more than 4096 keys" in data[P.HEADER_SIZE : P.HEADER_SIZE + first.payload_len]
    second = P.decode_header(data, 1 << 20, P.HEADER_SIZE + first.payload_len)
    assert (second.code, second.request_id) == (Status.OK, 2)  # the connection stays usable
    # The client splits long lists and stops at the first request that misses.
    c = CacheServerClient("127.0.0.1", cache_server.port)
    keys = [f"k{i}".encode() for i in range(2 * P.MAX_KEYS_PER_REQUEST + 10)]
    c.put_many([(k, b"") for k in keys[:P.MAX_KEYS_PER_REQUEST + 5]])
    assert c.prefix_hits(keys) == P.MAX_KEYS_PER_REQUEST + 5
    assert c.prefix_hits(keys[:P.MAX_KEYS_PER_REQUEST]) == P.MAX_KEYS_PER_REQUEST
    c.close()


@pytest.mark.parametrize(("args", "message"), [
    (("--max-connections", "0"), "--max-connections must be at least 1, got 0"),
    (("--frame-timeout", "0"), "--frame-timeout must be positive, got 0.0"),
])
def test_limit_options_are_checked(cache_server_factory: type[CacheServerProcess], args: tuple[str, ...],
                                   message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        cache_server_factory(*args)
