"""--disk: evicted entries spill to disk within their own budget, and a restart keeps data."""

from __future__ import annotations

import os
import shutil
import signal

import pytest

from harness.cache_server import CacheServerProcess
from kvstore.backends.server_client import CacheServerClient
from tests.fixtures.cache_server import live_dir, settled

MIB = 1 << 20


def test_spill_within_both_budgets(cache_server_factory: type[CacheServerProcess], tmp_path) -> None:
    server = cache_server_factory("--max-bytes", "3MiB", "--disk", str(tmp_path), "--max-disk-bytes", "8MiB")
    c = CacheServerClient("127.0.0.1", server.port)
    values = {f"k{i}".encode(): os.urandom(MIB) for i in range(10)}
    for k, v in values.items():
        assert c.put(k, v)
        s = settled(c)
        assert s["bytes"] + s["spilling_bytes"] <= 3 * MIB and s["disk_bytes"] <= 8 * MIB
        assert s["disk_bytes"] == sum(p.stat().st_size for p in live_dir(tmp_path).iterdir())
    # 2 in memory (key bytes count), 7 on disk (file headers count), the oldest dropped.
    assert (s["entries"], s["disk_entries"], s["disk_evictions"]) == (2, 7, 1)
    assert c.get(b"k0") is None and c.prefix_hits(list(values)[1:]) == 9
    assert c.get(b"k3") == values[b"k3"] and c.stats()["disk_hits"] == 1  # promoted from disk
    s = c.stats()
    assert s["bytes"] <= 3 * MIB and s["disk_bytes"] <= 8 * MIB and s["entries"] + s["disk_entries"] == 9
    c.close()


def test_restart_keeps_data(cache_server_factory: type[CacheServerProcess], tmp_path) -> None:
    server = cache_server_factory("--max-bytes", "3MiB", "--disk", str(tmp_path), "--max-disk-bytes", "64MiB")
    c = CacheServerClient("127.0.0.1", server.port)
    values = {f"k{i}".encode(): os.urandom(MIB) for i in range(10)}
    assert all(c.put_many(list(values.items())))
    assert c.get(b"k3") == values[b"k3"]  # one promoted back into memory
    assert server.stop(signal.SIGTERM) == 0  # memory is written to disk on the way out
    server.start()
    assert c.get_many(list(values)) == list(values.values())  # the pooled client reconnects
    assert c.reconnects == 1 and c.stats()["disk_hits"] == 10
    c.close()


def test_spilled_entries_survive_a_kill(cache_server_factory: type[CacheServerProcess], tmp_path) -> None:
    server = cache_server_factory("--max-bytes", "2MiB", "--disk", str(tmp_path))
    c = CacheServerClient("127.0.0.1", server.port)
    values = {f"k{i}".encode(): os.urandom(MIB) for i in range(4)}
    assert all(c.put_many(list(values.items())))
    server.kill()  # no clean shutdown: only what had spilled is on disk
    server.start()
    assert c.get_many(list(values)[:3]) == list(values.values())[:3]
    c.close()


def test_damaged_spill_file_is_a_miss(cache_server_factory: type[CacheServerProcess], tmp_path) -> None:
    server = cache_server_factory("--max-bytes", "1MiB", "--disk", str(tmp_path))
    c = CacheServerClient("127.0.0.1", server.port)
    a, b = os.urandom(700_000), os.urandom(700_000)
    c.put(b"a", a)
    c.put(b"b", b)  # evicts a to disk
    settled(c)
    [path] = list(live_dir(tmp_path).iterdir())
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(data)
    assert c.exists(b"a") and c.get(b"a") is None and not c.exists(b"a")
    assert c.stats()["disk_corrupt"] == 1 and c.get(b"b") == b
    c.close()


def test_entries_that_are_not_regular_files_are_skipped(
    cache_server_factory: type[CacheServerProcess], tmp_path
) -> None:
    server = cache_server_factory("--max-bytes", "1MiB", "--disk", str(tmp_path))
    c = CacheServerClient("127.0.0.1", server.port)
    a, b = os.urandom(700_000), os.urandom(700_000)
    assert c.put(b"a", a) and c.put(b"b", b)  # a spills to disk
    assert server.stop() == 0
    live = live_dir(tmp_path)
    (live / ("0" * 64 + ".kvs")).mkdir()  # once an IsADirectoryError at startup
    os.mkfifo(live / ("1" * 64 + ".kvs"))  # opening it would block the server forever
    (live / ("2" * 64 + ".kvs")).symlink_to("/dev/zero")
    (live / "interrupted.kvs.tmp").mkdir()
    server.start()
    assert c.get_many([b"a", b"b"]) == [a, b]
    code, err = server.stop_and_read()
    assert code == 0 and err.count("not a regular file") == 4
    assert (live / ("0" * 64 + ".kvs")).is_dir()  # skipped, not removed
    c.close()


def _unprivileged() -> list[str]:
    """A command prefix under which permission bits bind (root ignores them otherwise)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot make a directory read-only to the server")
    caps = "-dac_override,-dac_read_search,-fowner"
    return ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"]


def test_a_spill_directory_that_turns_read_only(cache_server_factory: type[CacheServerProcess], tmp_path) -> None:
    spill = tmp_path / "spill"
    server = cache_server_factory("--max-bytes", "2MiB", "--disk", str(spill), prefix=_unprivileged())
    c = CacheServerClient("127.0.0.1", server.port)
    values = {f"k{i}".encode(): os.urandom(MIB) for i in range(6)}
    try:
        assert all(c.put_many(list(values.items())[:3]))  # k0 spills (1 MiB + key bytes: one fits)
        settled(c)
        assert len(list(live_dir(spill).iterdir())) == 2
        live_dir(spill).chmod(0o500)
        assert all(c.put_many(list(values.items())[3:]))  # evictions cannot be written: dropped
        assert c.get(b"k5") == values[b"k5"]  # memory keeps serving
        assert c.get(b"k0") == values[b"k0"]  # reads from the read-only directory still work
        stats = c.stats()
        assert stats["bytes"] <= 2 * MIB
        code, err = server.stop_and_read()  # the flush to disk fails too: logged, exit 0
        assert code == 0 and "stopped accepting writes" in err and "Traceback" not in err
    finally:
        live_dir(spill).chmod(0o700)
    c.close()
