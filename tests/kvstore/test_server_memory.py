"""Hostile client mixes against a real server process: its resident memory stays under
--max-bytes + a fixed overhead (docs/protocol.md, "Memory bound"), measured from the
kernel's own peak (VmHWM in /proc/<pid>/status), and well-behaved clients keep being served."""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest

from harness.cache_server import CacheServerProcess
from harness.polling import wait_until
from kvstore.backends.server_client import CacheServerClient
from kvstore.cache_server import protocol as P
from kvstore.cache_server.protocol import Op, Status
from kvstore.cache_server.server import HEAP_SLACK_BYTES, PER_CONNECTION_BYTES

MIB = 1 << 20
# Measurement tolerance on top of the documented overhead (Python objects, page rounding).
TOLERANCE = 4 * MIB

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")


def _base_rss(server: CacheServerProcess) -> int:
    """Resident bytes of the idle server after one round trip (imports done, loop running)."""
    c = CacheServerClient("127.0.0.1", server.port)
    assert c.ping()
    c.close()
    return server.memory_bytes("VmRSS")


def _peak_rss(server: CacheServerProcess) -> int:
    return server.memory_bytes("VmHWM")


def _bound(base: int, max_bytes: int, connections: int) -> int:
    """The documented ceiling (docs/protocol.md, "Memory bound")."""
    return base + max_bytes + HEAP_SLACK_BYTES + connections * PER_CONNECTION_BYTES + TOLERANCE


@contextmanager
def _raw_sockets(port: int, n: int, rcvbuf: int | None = None) -> Iterator[list[socket.socket]]:
    with ExitStack() as stack:
        socks = []
        for _ in range(n):
            s = socket.socket()
            stack.enter_context(s)
            if rcvbuf is not None:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            s.settimeout(10)
            s.connect(("127.0.0.1", port))
            socks.append(s)
        yield socks


def _closed_or_status(sock: socket.socket) -> int | None:
    """Returns the status of the first reply on `sock`, or None if it was closed silently."""
    try:
        data = sock.recv(P.HEADER_SIZE, socket.MSG_WAITALL)
    except (ConnectionResetError, TimeoutError):
        return None
    return P.decode_header(data, 1 << 20).code if len(data) == P.HEADER_SIZE else None


def test_announced_bodies_wait_for_memory(cache_server_factory: type[CacheServerProcess]) -> None:
    """16 connections each announce a 60 MiB PUT and send nothing more, against a 64 MiB
    budget: one body at a time is admitted, the rest wait, then are refused (BUSY) or closed
    at their frame deadline; nothing else stops working and memory stays bounded."""
    server = cache_server_factory("--max-bytes", "64MiB", "--frame-timeout", "1")
    base = _base_rss(server)
    good = CacheServerClient("127.0.0.1", server.port)
    value = os.urandom(2 * MIB)
    with _raw_sockets(server.port, 16) as attackers:
        for s in attackers:
            s.sendall(P.encode_header(Op.PUT, 7, 1, 60 * MIB) + b"k")
        assert wait_until(lambda: good.stats()["waiting_for_memory"] == 15, 10.0)
        stats = good.stats()
        assert stats["reserved_bytes"] == 60 * MIB + 1 and stats["bytes"] + stats["reserved_bytes"] <= 64 * MIB
        # Well-behaved clients are served meanwhile, large values included (room is evicted).
        for i in range(4):
            assert good.put(f"v{i}".encode(), value) and good.get(f"v{i}".encode()) == value
        replies = [_closed_or_status(s) for s in attackers]
    assert set(replies) <= {Status.BUSY, None} and Status.BUSY in replies
    stats = good.stats()
    assert stats["reserved_bytes"] == 0 and stats["waiting_for_memory"] == 0 and stats["busy_refusals"] >= 1
    assert good.get(b"v3") == value
    peak = _peak_rss(server)
    print(f"announced bodies: base {base / MIB:.1f} MiB, peak {peak / MIB:.1f} MiB")
    assert peak <= _bound(base, 64 * MIB, 17), (peak - base) / MIB
    good.close()


def test_drip_fed_frames_hit_their_deadline(cache_server_factory: type[CacheServerProcess]) -> None:
    """A byte every 0.2 s keeps a connection active (no idle timeout) but its frame never
    completes: the frame deadline closes it."""
    server = cache_server_factory("--frame-timeout", "1", "--idle-timeout", "300")
    frame = P.encode_header(Op.PUT, 1, 1, 100_000) + b"k"
    with _raw_sockets(server.port, 1) as [s]:
        t0 = time.monotonic()
        closed = False
        for i in range(len(frame) + 100):  # bounded: far past the deadline
            try:
                s.sendall(frame[i : i + 1] or b"x")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.2)
            if time.monotonic() - t0 > 10:
                break
        elapsed = time.monotonic() - t0
    assert closed and elapsed < 5
    assert CacheServerClient("127.0.0.1", server.port).stats()["frame_timeouts"] == 1


def test_readers_that_never_read_share_one_buffer(cache_server_factory: type[CacheServerProcess]) -> None:
    """20 clients GET a 32 MiB value and never read. Replies are sent from the stored buffer
    (no copy per connection); replacing the value keeps the old one counted while it is
    being sent; the stalled readers are closed at the reply deadline, which frees it."""
    server = cache_server_factory("--max-bytes", "80MiB", "--frame-timeout", "2")
    base = _base_rss(server)
    good = CacheServerClient("127.0.0.1", server.port)
    old, new = os.urandom(32 * MIB), os.urandom(32 * MIB)
    assert good.put(b"v", old)
    with _raw_sockets(server.port, 20, rcvbuf=64 << 10) as readers:
        for s in readers:
            s.sendall(P.encode_frame(Op.GET, 1, b"v"))
        assert wait_until(lambda: good.stats()["connections"] == 21, 10.0)
        time.sleep(0.3)  # let every reply start
        assert good.put(b"v", new)  # the old value leaves the store but is still being sent
        stats = good.stats()
        assert stats["pinned_bytes"] == 32 * MIB + 1 and stats["bytes"] == 32 * MIB + 1
        assert good.get(b"v") == new
        # 50 MiB more does not fit beside the value being sent: the PUT waits for room, which
        # comes when the reply deadline closes the stalled readers and frees the old value.
        assert good.put(b"w", bytes(50 * MIB))
        stats = good.stats()
        assert stats["connections"] == 1 and stats["frame_timeouts"] == 20 and stats["pinned_bytes"] == 0
        assert stats["bytes"] == 50 * MIB + 1 and not good.exists(b"v")  # evicted to make room
    peak = _peak_rss(server)
    print(f"stalled readers: base {base / MIB:.1f} MiB, peak {peak / MIB:.1f} MiB")
    assert peak <= _bound(base, 80 * MIB, 21), (peak - base) / MIB
    good.close()


def test_churn_of_varied_sizes_stays_bounded(cache_server_factory: type[CacheServerProcess]) -> None:
    """Four clients PUT and GET values from 1 KB to 40 MiB at random into a 64 MiB budget:
    freed buffers that the next ones do not fit must not grow the process past the bound
    (the allocator is trimmed), and every GET returns what was last stored or a miss."""
    server = cache_server_factory("--max-bytes", "64MiB")
    base = _base_rss(server)
    blob = os.urandom(40 * MIB)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        c = CacheServerClient("127.0.0.1", server.port, timeout=30)
        try:
            for _ in range(120):
                n = rng.randint(1, 40 * MIB) if rng.random() < 0.2 else rng.randint(1000, 6 * MIB)
                key = f"{seed}/{rng.randint(0, 20)}".encode()
                if rng.random() < 0.6:
                    assert c.put(key, memoryview(blob)[:n]), (
                        n,
                        {
                            k: v
                            for k, v in c.stats().items()
                            if k
                            in (
                                "busy_refusals",
                                "rejected",
                                "reserved_bytes",
                                "pinned_bytes",
                                "bytes",
                                "frame_timeouts",
                            )
                        },
                    )
                else:
                    got = c.get(key)
                    assert got is None or got == blob[: len(got)]
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            c.close()

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    peak = _peak_rss(server)
    print(f"churn: base {base / MIB:.1f} MiB, peak {peak / MIB:.1f} MiB")
    assert peak <= _bound(base, 64 * MIB, 5), (peak - base) / MIB


def test_slow_readers_get_every_byte(cache_server_factory: type[CacheServerProcess]) -> None:
    """A reader slower than the network but faster than the deadline gets the whole value,
    sent in slices from the stored buffer."""
    server = cache_server_factory("--max-bytes", "64MiB", "--frame-timeout", "2")
    good = CacheServerClient("127.0.0.1", server.port)
    value = os.urandom(8 * MIB)
    assert good.put(b"v", value)
    with _raw_sockets(server.port, 3, rcvbuf=64 << 10) as readers:
        for s in readers:
            s.sendall(P.encode_frame(Op.GET, 5, b"v"))
        time.sleep(0.2)
        assert good.stats()["pinned_bytes"] == 0  # still stored: nothing extra is counted
        for s in readers:
            got = bytearray()
            while len(got) < P.HEADER_SIZE + len(value):
                chunk = s.recv(1 << 20)
                assert chunk
                got += chunk
            assert P.decode_header(got, 1 << 30).code == Status.OK and got[P.HEADER_SIZE :] == value
    good.close()
