"""The cache server over real loopback sockets: every op, concurrency, eviction, timeouts, signals."""

from __future__ import annotations

import os
import platform
import signal
import socket
import threading
import time

import pytest

from harness.cache_server import CacheServerProcess
from kvstore.backends.server_client import CacheServerClient, ServerUnavailable
from kvstore.cache_server import protocol as P
from kvstore.cache_server.protocol import Op, Status
from kvstore.cache_server.server import ServerConfig, StoreBudgets
from tests.fixtures.cache_server import raw_exchange


def _client(server: CacheServerProcess, **kw: object) -> CacheServerClient:
    return CacheServerClient("127.0.0.1", server.port, **kw)  # type: ignore[arg-type]


def test_every_op_round_trips(cache_server: CacheServerProcess) -> None:
    c = _client(cache_server)
    assert c.ping()
    big = os.urandom(6 << 20)  # about one 256-token chunk of the default model
    key = b"model/fp16/\x00\xffchunk"  # keys are arbitrary bytes
    assert c.put(key, big) and c.put(b"empty", b"")
    assert c.get(key) == big and c.get(b"empty") == b"" and c.get(b"absent") is None
    assert c.exists(key) and not c.exists(b"absent")
    assert c.exists_many([key, b"absent", b"empty"]) == [True, False, True]
    assert c.prefix_hits([key, b"empty", b"absent", key]) == 2
    assert c.prefix_hits([b"absent", key]) == 0
    assert c.get_many([b"absent", b"empty", key]) == [None, b"", big]
    assert c.put(key, b"replaced") and c.get(key) == b"replaced"
    stats = c.stats()
    assert stats["entries"] == 2 and stats["bytes"] == len(key) + len(b"replaced") + len(b"empty")
    assert stats["hits"] == 5 and stats["misses"] == 2 and stats["evictions"] == 0
    assert c.delete(key) and not c.delete(key) and not c.exists(key)
    c.clear()
    assert c.stats()["entries"] == 0 and c.get(b"empty") is None
    c.close()


def test_batches_larger_than_the_pipeline_window(cache_server: CacheServerProcess) -> None:
    c = _client(cache_server)
    items = [(f"k{i}".encode(), os.urandom(i * 997 % 70_000)) for i in range(300)]
    assert all(c.put_many(items))
    assert c.get_many([k for k, _ in items]) == [v for _, v in items]
    assert c.prefix_hits([k for k, _ in items]) == 300
    c.close()


def test_sixteen_concurrent_clients(cache_server: CacheServerProcess) -> None:
    shared = os.urandom(300_000)
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            c = _client(cache_server)
            mine = {f"c{n}/k{i}".encode(): os.urandom(1000 * (n + 1) + i) for i in range(40)}
            for k, v in mine.items():
                assert c.put(k, v)
            c.put(b"shared", shared)
            for _ in range(3):
                assert c.get_many(list(mine)) == list(mine.values())
                assert c.get(b"shared") == shared
                assert c.prefix_hits(list(mine)) == len(mine)
            c.close()
        except BaseException as exc:  # surfaced below with the thread's own traceback
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    stats = _client(cache_server).stats()
    assert stats["entries"] == 16 * 40 + 1 and stats["total_connections"] >= 16


def test_one_client_shared_by_threads(cache_server: CacheServerProcess) -> None:
    c = _client(cache_server, pool_size=4)
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(30):
                k, v = f"t{n}/{i}".encode(), os.urandom(5000 + i)
                assert c.put(k, v) and c.get(k) == v
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert c.stats()["entries"] == 240
    c.close()


def test_eviction_never_exceeds_the_budget(cache_server_factory: type[CacheServerProcess]) -> None:
    server = cache_server_factory("--max-bytes", "4MiB")
    c = _client(server)
    value = os.urandom(1 << 20)
    for i in range(20):
        assert c.put(f"k{i:02d}".encode(), value)
        stats = c.stats()
        assert stats["bytes"] <= 4 << 20 and stats["max_bytes"] == 4 << 20
    assert stats["entries"] == 3 and stats["evictions"] == 17  # key bytes count too: 4 do not fit
    assert c.prefix_hits([b"k17", b"k18", b"k19"]) == 3 and not c.exists(b"k16")
    # LRU, not FIFO: reading k17 protects it from the next eviction.
    assert c.get(b"k17") == value
    c.put(b"k20", value)
    assert c.exists(b"k17") and not c.exists(b"k18")
    # A value larger than the whole budget is refused; the connection keeps working.
    assert not c.put(b"huge", bytes(5 << 20))
    assert c.get(b"k17") == value and c.stats()["bytes"] <= 4 << 20
    c.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_stop_cleanly(cache_server_factory: type[CacheServerProcess], sig: int) -> None:
    server = cache_server_factory()
    c = _client(server)
    c.put(b"k", b"v")  # an open pooled connection must not hold up shutdown
    assert server.stop(sig) == 0
    with pytest.raises(ServerUnavailable):
        c.get(b"k")


def test_idle_and_slow_clients_are_disconnected(cache_server_factory: type[CacheServerProcess]) -> None:
    server = cache_server_factory("--idle-timeout", "0.5")
    c = _client(server)
    assert c.put(b"k", b"v")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as slow:
        slow.sendall(P.encode_header(Op.PUT, 1, 1, 100) + b"k" + b"x" * 10)  # then stalls
        t0 = time.monotonic()
        assert slow.recv(100) == b""  # closed by the server, not by our 10 s timeout
        assert time.monotonic() - t0 < 9
    # The pooled connection was idle-closed too: the client reconnects transparently.
    time.sleep(1.0)
    assert c.get(b"k") == b"v" and c.reconnects == 1
    assert not c.exists(b"x")
    c.close()


def test_pipelined_requests_on_one_raw_connection(cache_server: CacheServerProcess) -> None:
    frames = b"".join([
        P.encode_frame(Op.PUT, 1, b"a", b"alpha"),
        P.encode_frame(Op.GET, 2, b"a"),
        P.encode_frame(Op.EXISTS, 3, b"b"),
        P.encode_frame(Op.PING, 4),
    ])
    data = raw_exchange(cache_server.port, frames)
    replies = []
    while data:
        h = P.decode_header(data, max_payload=1 << 20)
        replies.append((h.code, h.request_id, data[P.HEADER_SIZE : P.HEADER_SIZE + h.payload_len]))
        data = data[P.HEADER_SIZE + h.payload_len :]
    assert replies == [(Status.OK, 1, b""), (Status.OK, 2, b"alpha"), (Status.NOT_FOUND, 3, b""),
                       (Status.OK, 4, b"PONG")]


def test_command_line_errors_name_the_problem(cache_server_factory: type[CacheServerProcess]) -> None:
    with pytest.raises(RuntimeError, match="--max-bytes: invalid size 'lots'"):
        cache_server_factory("--max-bytes", "lots")
    first = cache_server_factory()
    with pytest.raises(RuntimeError, match="address already in use|Address already in use"):
        cache_server_factory(port=first.port)


def test_cache_server_subcommand_contract() -> None:
    """`kvtier cache-server` is wired to this module, which meets the subcommand contract."""
    import argparse

    from kvtier import cli, cmd_cache_server

    assert cli.SUBCOMMANDS["cache-server"] == "kvtier.cmd_cache_server"
    parser = argparse.ArgumentParser()
    cmd_cache_server.add_arguments(parser)
    args = parser.parse_args(["--port", "0", "--max-bytes", "1GiB", "--max-payload", "1.5GB"])
    assert args.host == "127.0.0.1" and callable(cmd_cache_server.run) and cmd_cache_server.HELP
    assert args.max_bytes == 1 << 30 and args.max_payload == 1_500_000_000  # sizes parse as the flag is read
    with pytest.raises(ValueError, match="--max-payload must be positive, got 0"):
        ServerConfig(max_payload=0).validate()
    with pytest.raises(ValueError, match="--max-bytes: size 0 must be positive"):
        StoreBudgets(max_bytes=0).validate()
    if platform.libc_ver()[0] == "glibc":
        assert cmd_cache_server.keep_freed_memory()


def test_a_server_that_never_answers_times_out() -> None:
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()  # accepts connections (backlog) but never reads or replies
        c = CacheServerClient("127.0.0.1", mute.getsockname()[1], timeout=0.3)
        with pytest.raises(ServerUnavailable, match="no reply from the cache server within 0.3 s"):
            c.ping()


def test_a_client_that_reads_late_gets_every_reply(cache_server: CacheServerProcess) -> None:
    """Many large GETs pipelined before reading anything: the server stops reading requests
    while replies pile up (backpressure) instead of buffering them all, and loses none."""
    value = os.urandom(1 << 20)
    c = _client(cache_server)
    c.put(b"v", value)
    n = 64
    with socket.create_connection(("127.0.0.1", cache_server.port), timeout=30) as sock:
        sock.sendall(b"".join(P.encode_frame(Op.GET, i, b"v") for i in range(n)))
        time.sleep(0.5)
        assert c.ping()  # others are served meanwhile
        reader = sock.makefile("rb")
        for i in range(n):
            h = P.decode_header(reader.read(P.HEADER_SIZE), max_payload=1 << 30)
            assert (h.code, h.request_id) == (Status.OK, i) and reader.read(h.payload_len) == value
    c.close()


def test_mixed_pipelines_of_large_gets_and_puts(cache_server: CacheServerProcess) -> None:
    """Large GETs and large PUTs in one call: the client must not send a large payload while
    a large reply it has not read yet holds the server back."""
    from kvstore.backends.server_client import Request

    c = _client(cache_server, timeout=20)
    values = [os.urandom(4 << 20) for _ in range(6)]
    c.put_many([(f"v{i}".encode(), v) for i, v in enumerate(values)])
    requests = []
    for i, v in enumerate(values):
        requests += [Request(Op.GET, f"v{i}".encode()), Request(Op.PUT, f"w{i}".encode(), v)]
    replies = c.call(requests)
    assert [r.payload for r in replies[0::2]] == values and all(r.status == Status.OK for r in replies)
    assert c.get_many([f"w{i}".encode() for i in range(6)]) == values
    c.close()


def test_oversized_non_put_body_is_refused_without_buffering(cache_server: CacheServerProcess) -> None:
    body = bytes(P.MAX_REQUEST_BODY + 1)  # under --max-payload: well framed, but no key list is this long
    data = P.encode_header(Op.EXISTS, 1, 0, len(body)) + body + P.encode_frame(Op.PING, 2)
    replies = raw_exchange(cache_server.port, data)
    first = P.decode_header(replies, max_payload=1 << 20)
    assert first.code == Status.TOO_LARGE and first.request_id == 1
    second = P.decode_header(replies, max_payload=1 << 20, offset=P.HEADER_SIZE + first.payload_len)
    assert (second.code, second.request_id) == (Status.OK, 2)  # the connection stayed usable
