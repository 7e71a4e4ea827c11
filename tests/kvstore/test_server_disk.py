"""--disk: evicted entries spill to disk within their own budget, and a restart keeps data."""

from __future__ import annotations

import os
import signal

from kvstore.server.client import CacheServerClient
from tests.fixtures.cache_server import CacheServerProcess

MIB = 1 << 20


def test_spill_within_both_budgets(cache_server_factory: type[CacheServerProcess], tmp_path) -> None:
    server = cache_server_factory("--max-bytes", "3MiB", "--disk", str(tmp_path), "--max-disk-bytes", "8MiB")
    c = CacheServerClient("127.0.0.1", server.port)
    values = {f"k{i}".encode(): os.urandom(MIB) for i in range(10)}
    for k, v in values.items():
        assert c.put(k, v)
        s = c.stats()
        assert s["bytes"] <= 3 * MIB and s["disk_bytes"] <= 8 * MIB
        assert s["disk_bytes"] == sum(p.stat().st_size for p in tmp_path.iterdir())
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
    [path] = list(tmp_path.iterdir())
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(data)
    assert c.exists(b"a") and c.get(b"a") is None and not c.exists(b"a")
    assert c.stats()["disk_corrupt"] == 1 and c.get(b"b") == b
    c.close()
