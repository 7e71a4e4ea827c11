"""The disk spill's I/O runs off the event loop: a stalled disk write, a disk read or a
CLEAR of thousands of files never stops the server answering other requests, and a GET
racing a spill gets the right value.

The stalled disk is deterministic: a FIFO planted at the temporary name a spill write
opens blocks that write until the test reads the FIFO, and the test waits until the write
is inside it (a write still queued behind others could be cancelled and never stall).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import select
import signal
import threading
import time
from pathlib import Path

from harness.cache_server import CacheServerProcess
from harness.polling import wait_until
from kvstore.backends.server_client import CacheServerClient, ServerUnavailable
from kvstore.cache_server.server import ServerConfig
from kvstore.deadlines import CACHE_SERVER_CLIENT_TIMEOUT_S, CACHE_SERVER_FRAME_TIMEOUT_S
from tests.fixtures.cache_server import live_dir, settled

MIB = 1 << 20
_TIMEOUT = 5.0  # client timeout: a blocked event loop fails the test instead of hanging it


class _StalledWrite:
    """A FIFO planted where the spill write of `key` opens its temporary file: that write
    blocks once the pipe is full (64 KiB; every value stalled here is larger) until
    `release` reads it. The read end is open from the start, so the write's open never
    blocks and `wait_entered` sees its first bytes arrive."""

    def __init__(self, directory: Path, key: bytes) -> None:
        self.path = directory / (hashlib.sha256(key).hexdigest() + ".kvs.tmp")
        os.mkfifo(self.path)
        self._fd: int | None = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        self.data = bytearray()

    def _read_some(self, deadline: float) -> bool:
        """Reads what the pipe holds; returns False once `deadline` passes with nothing read."""
        assert self._fd is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self._fd], [], [], 0.1)
            chunk = os.read(self._fd, 1 << 20) if ready else b""
            if chunk:  # b"" also means no writer has opened yet: poll again
                self.data += chunk
                return True
        return False

    def wait_entered(self, timeout: float = 30.0) -> None:
        """Waits until the write has begun (the disk worker is now stuck in it: a job queued
        behind it cannot run, and a cancel no longer skips it)."""
        assert self._read_some(time.monotonic() + timeout), "the spill write never reached the FIFO"

    def release(self, expect: int, timeout: float = 30.0) -> bytes:
        """Reads the stalled write whole (`expect` bytes), letting it finish; returns them."""
        if self._fd is None:
            return bytes(self.data)
        deadline = time.monotonic() + timeout
        try:
            while len(self.data) < expect and self._read_some(deadline):
                pass
        finally:
            os.close(self._fd)
            self._fd = None
        return bytes(self.data)


_K_SIZE = 600 << 10  # k's value: its spill write stalls (20 header + 1 key + this many bytes)


def _stall_worker(port: int, directory: Path) -> tuple[_StalledWrite, threading.Thread]:
    """Leaves the disk worker stuck in the spill write of `k` (a FIFO in `directory`, the
    live generation), with a PUT of `k2` waiting for the memory that write holds: puts k,
    then k2 on a thread (its eviction of k is the stalled write). Returns the stall and the
    thread, which ends once the stall is released, or quietly if the server dies."""
    stall = _StalledWrite(directory, b"k")
    c = CacheServerClient("127.0.0.1", port, timeout=_TIMEOUT)

    def put_k2() -> None:
        writer = CacheServerClient("127.0.0.1", port, timeout=60)
        try:
            writer.put(b"k2", os.urandom(_K_SIZE))
        except ServerUnavailable:
            pass  # the test killed the server under it
        finally:
            writer.close()

    try:
        assert c.put(b"k", os.urandom(_K_SIZE))
        thread = threading.Thread(target=put_k2, daemon=True)
        thread.start()
        stall.wait_entered()  # anything queued from now on (a CLEAR's removal) waits behind it
        assert wait_until(lambda: c.stats()["waiting_for_memory"] == 1, 10.0, 0.02)
    finally:
        c.close()
    return stall, thread


def test_a_stalled_spill_write_does_not_stall_other_clients(
    cache_server_factory: type[CacheServerProcess], tmp_path
) -> None:
    server = cache_server_factory("--max-bytes", "2MiB", "--disk", str(tmp_path))
    c = CacheServerClient("127.0.0.1", server.port, timeout=_TIMEOUT)
    v0, v1 = os.urandom(MIB), os.urandom(MIB)
    stall = _StalledWrite(live_dir(tmp_path), b"k0")
    assert c.put(b"k0", v0)
    # k1 evicts k0 to disk; its write blocks on the FIFO, so k1 waits for k0's bytes.
    writer = CacheServerClient("127.0.0.1", server.port, timeout=60)
    put_k1: list[bool] = []
    thread = threading.Thread(target=lambda: put_k1.append(writer.put(b"k1", v1)))
    thread.start()
    try:
        stall.wait_entered()
        assert wait_until(lambda: c.stats()["waiting_for_memory"] == 1, 10.0, 0.02)
        # The event loop keeps serving everything that does not need the disk.
        assert c.ping() and c.exists(b"k0") and c.put(b"small", b"s" * 100)
        assert c.get(b"k0") == v0  # its write is stuck: answered from memory, exactly
        assert c.get(b"small") == b"s" * 100 and not put_k1
        stats = c.stats()
        assert stats["bytes"] + stats["reserved_bytes"] + stats["pinned_bytes"] + stats["spilling_bytes"] <= 2 * MIB
    finally:
        written = stall.release(20 + 2 + MIB)
        thread.join(30)
    assert written.endswith(v0)  # the stalled write was k0's entry, whole
    assert put_k1 == [True]
    assert c.get_many([b"k0", b"k1", b"small"]) == [v0, v1, b"s" * 100]
    stats = settled(c)
    assert stats["spilling_bytes"] == 0 and stats["reserved_bytes"] == 0 and stats["pinned_bytes"] == 0
    assert stats["disk_bytes"] == sum(p.stat().st_size for p in live_dir(tmp_path).iterdir() if p.is_file())
    assert server.stop() == 0
    c.close()
    writer.close()


def test_clear_answers_at_once_and_removes_files_in_the_background(
    cache_server_factory: type[CacheServerProcess], tmp_path
) -> None:
    server = cache_server_factory("--max-bytes", "1MiB", "--disk", str(tmp_path), "--max-disk-bytes", "256MiB")
    c = CacheServerClient("127.0.0.1", server.port, timeout=_TIMEOUT)
    values = [(f"old{i}".encode(), os.urandom(4096)) for i in range(3000)]
    assert all(c.put_many(values))
    stats = settled(c)
    old = live_dir(tmp_path)
    n_files = len(list(old.iterdir()))
    assert n_files == stats["disk_entries"] > 2500
    stall, thread = _stall_worker(server.port, old)
    try:
        c.clear()  # answered although the disk worker is stuck and thousands of files remain
        assert c.ping() and c.get(values[0][0]) is None and not c.exists(values[-1][0])
        stats = c.stats()
        assert stats["disk_entries"] == 0 and stats["disk_bytes"] == 0
        assert len(list(old.iterdir())) >= n_files  # nothing removed yet: the loop did not wait
        assert live_dir(tmp_path) != old  # a new generation is live
        assert c.put(b"new", b"n" * 10) and c.get(b"new") == b"n" * 10
    finally:
        stall.release(20 + 1 + _K_SIZE)
        thread.join(30)
    assert wait_until(lambda: not old.exists(), 60.0, 0.02)  # removed in the background
    assert c.get(values[1][0]) is None and c.get(b"new") == b"n" * 10
    assert c.prefix_hits([k for k, _ in values[:10]]) == 0
    c.close()


def test_a_crash_after_clear_never_brings_cleared_entries_back(
    cache_server_factory: type[CacheServerProcess], tmp_path
) -> None:
    server = cache_server_factory("--max-bytes", "1MiB", "--disk", str(tmp_path), "--max-disk-bytes", "64MiB")
    c = CacheServerClient("127.0.0.1", server.port, timeout=_TIMEOUT)
    values = [(f"old{i}".encode(), os.urandom(4096)) for i in range(1000)]
    assert all(c.put_many(values))
    n_files = settled(c)["disk_entries"]
    old = live_dir(tmp_path)
    stall, _ = _stall_worker(server.port, old)  # so the old generation is still whole
    fresh = CacheServerClient("127.0.0.1", server.port, timeout=_TIMEOUT)
    fresh.clear()
    assert len(list(old.iterdir())) > n_files > 500  # the files are still there when it dies
    server.stop(signal.SIGKILL)
    server.start()
    assert fresh.prefix_hits([k for k, _ in values]) == 0 and fresh.get(values[0][0]) is None
    assert wait_until(lambda: not old.exists(), 60.0, 0.02)  # the restart removes what CLEAR left
    assert not stall.path.exists()
    stall.release(0)
    c.close()
    fresh.close()


def test_sigterm_with_a_stuck_disk_exits_keeping_what_was_written(
    cache_server_factory: type[CacheServerProcess], tmp_path
) -> None:
    """Shutdown writes memory to disk, but gives up on a disk that has finished nothing for
    --frame-timeout: SIGTERM exits 0 (it used to hang), and a restart serves what was written."""
    server = cache_server_factory("--max-bytes", "4MiB", "--disk", str(tmp_path), "--frame-timeout", "1")
    c = CacheServerClient("127.0.0.1", server.port, timeout=_TIMEOUT)
    kept, stuck = os.urandom(1000), os.urandom(MIB)
    stall = _StalledWrite(live_dir(tmp_path), b"stuck")
    assert c.put(b"kept", kept) and c.put(b"stuck", stuck)  # flushed in LRU order: kept, then stuck
    c.close()
    try:
        code, err = server.stop_and_read(timeout=30)
    finally:
        stall.release(0)
    assert code == 0 and "the disk finished nothing for 1.0 s" in err, err[-2000:]
    server.start()
    c = CacheServerClient("127.0.0.1", server.port, timeout=_TIMEOUT)
    assert c.get(b"kept") == kept and c.get(b"stuck") is None
    c.close()


def test_gets_racing_spills_get_the_right_value(cache_server_factory: type[CacheServerProcess], tmp_path) -> None:
    """Clients PUT and GET over a small memory budget, so entries keep moving to disk (and
    back) while others read them: a GET answers the stored value or, rarely, a miss."""
    server = cache_server_factory("--max-bytes", "4MiB", "--disk", str(tmp_path), "--max-disk-bytes", "512MiB")
    keys = [f"key{i}".encode() for i in range(48)]
    value = {k: hashlib.sha256(k).digest() * (2048 + 512 * i) for i, k in enumerate(keys)}  # 64..~800 KiB
    errors: list[str] = []
    hits = [0]

    def client(seed: int) -> None:
        rng = random.Random(seed)
        c = CacheServerClient("127.0.0.1", server.port, timeout=30)
        try:
            for _ in range(150):
                key = rng.choice(keys)
                if rng.random() < 0.4:
                    if not c.put(key, value[key]):
                        errors.append(f"put {key!r} refused")
                else:
                    got = c.get(key)
                    if got is not None:
                        hits[0] += 1
                        if got != value[key]:
                            errors.append(f"wrong value for {key!r}")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))
        finally:
            c.close()

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and hits[0] > 100
    c = CacheServerClient("127.0.0.1", server.port, timeout=30)
    stored = [k for k in keys if c.exists(k)]
    # One at a time: a pipelined GET may miss while earlier replies hold the memory its disk read needs.
    assert stored and [c.get(k) for k in stored] == [value[k] for k in stored]  # in memory or on disk, exact
    stats = settled(c)
    assert stats["reserved_bytes"] == 0 and stats["pinned_bytes"] == 0 and stats["spilling_bytes"] == 0
    assert stats["disk_corrupt"] == 0
    c.close()


def test_the_server_answers_before_its_clients_give_up(
    cache_server_factory: type[CacheServerProcess], tmp_path
) -> None:
    """Waiting on the disk is bounded by --frame-timeout: a body waiting for memory that a
    stalled spill holds is answered BUSY, a GET waiting for the disk a miss, both before a
    client whose timeout is the frame timeout + 5 s (the defaults' relation) gives up."""
    frame_timeout = 1.0
    server = cache_server_factory("--max-bytes", "2MiB", "--disk", str(tmp_path),
                                  "--frame-timeout", str(frame_timeout))
    timeout = frame_timeout + (CACHE_SERVER_CLIENT_TIMEOUT_S - CACHE_SERVER_FRAME_TIMEOUT_S)
    c = CacheServerClient("127.0.0.1", server.port, timeout=timeout)
    vd, v0 = os.urandom(MIB), os.urandom(MIB)
    assert c.put(b"d", vd) and c.put(b"k0", v0)  # d spills to disk
    settled(c)
    stall = _StalledWrite(live_dir(tmp_path), b"k0")
    try:
        assert not c.put(b"k1", os.urandom(MIB))  # k0's write stalls: BUSY after the frame timeout
        assert c.get(b"d") is None  # needs memory that the stalled write holds: a miss, in time
        stats = c.stats()
        assert stats["busy_refusals"] == 1 and stats["disk_read_timeouts"] == 1
    finally:
        stall.release(20 + 2 + MIB)
    assert c.get(b"d") == vd  # once the disk moves, its read completes
    # k0's bytes went into the test's FIFO, which the write then renamed into place: reads
    # refuse what is not a regular file, so it is a miss, never wrong bytes.
    assert c.get(b"k0") is None and c.stats()["disk_corrupt"] == 1
    c.close()


def test_client_timeout_outlasts_the_server_deadline() -> None:
    from kvtier import cmd_cache_server

    parser = argparse.ArgumentParser()
    cmd_cache_server.add_arguments(parser)
    server_default = parser.parse_args([]).frame_timeout
    assert server_default == ServerConfig().frame_timeout == CACHE_SERVER_FRAME_TIMEOUT_S
    assert CacheServerClient("127.0.0.1", 1).timeout == CACHE_SERVER_CLIENT_TIMEOUT_S > server_default
