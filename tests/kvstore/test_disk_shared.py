"""The disk tier's directory as a shared resource: a read-only, pre-warmed directory serves
reads, and processes sharing one directory keep it within one byte budget (temp files included)."""

from __future__ import annotations

import fcntl
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from harness import process
from kvstore.backends.disk import STATE_BYTES, STATE_FILE, DiskBackend
from kvstore.storage_manager import StorageManager
from tests.fixtures.tiers import chunk, ckey, disk_file_bytes

REPO = Path(__file__).resolve().parents[2]


@contextmanager
def read_only_mount(src: Path, dst: Path) -> Iterator[Path]:
    """Yields `dst`: `src` bind-mounted read-only (EROFS for every write, root included)."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    dst.mkdir()
    done = process.run(
        ["mount", "--bind", "-o", "ro", str(src), str(dst)], check=False, capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount read-only here: {done.stderr.strip()}")
    try:
        yield dst
    finally:
        process.run(["umount", str(dst)], check=True, timeout=60)


def test_a_read_only_directory_serves_reads_and_refuses_writes_clearly(tmp_path: Path) -> None:
    warm = DiskBackend(tmp_path / "warm")
    warm.batched_put([(ckey(i), chunk(i)) for i in range(20)])
    warm.close()
    with read_only_mount(tmp_path / "warm", tmp_path / "ro") as ro:
        tier = DiskBackend(ro)
        assert tier.read_only
        mgr = StorageManager([tier], names=["disk"])
        keys = [ckey(i) for i in range(20)]
        assert all(mgr.batched_contains(keys))
        got = [kv for kv, _ in mgr.fetch(keys)]  # reads used to fail touching mtime (EROFS)
        assert all(torch.equal(kv, chunk(i)) for i, kv in enumerate(got))
        mgr.batched_put([(ckey(99), chunk(99))])  # refused, never raised to the caller
        s = mgr.stats()["disk"]
        assert s.read_healthy and not s.write_healthy and "read-only" in s.last_error
        assert s.hits == 20 and torch.equal(mgr.fetch([ckey(3)])[0][0], chunk(3))  # reads go on
        mgr.close()


_WRITER = """
import sys
sys.path.insert(0, {repo!r})
from kvstore.backends.disk import DiskBackend
from tests.fixtures.tiers import chunk, ckey
tier = DiskBackend({root!r}, byte_budget={budget})
for i in range({n}):
    tier.put(ckey({seed} * 100000 + i), chunk(i, tokens=64))
    assert tier.stats().bytes_used <= {budget}
"""


def _dir_bytes_locked(root: Path) -> int:
    """Bytes of every file in `root`, counted while holding the directory's lock (so no file
    is renamed, removed or reserved mid-count; temp files being written grow within their
    reservation)."""
    fd = os.open(root / STATE_FILE, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        total = 0
        for entry in os.scandir(root):
            try:
                total += entry.stat().st_size
            except FileNotFoundError:
                pass
        return total
    finally:
        os.close(fd)  # releases the lock


def test_processes_sharing_a_directory_stay_within_one_budget(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    one = disk_file_bytes(tmp_path / "probe", chunk(0, tokens=64))
    budget = 10 * one + STATE_BYTES  # the state file counts too
    DiskBackend(root, byte_budget=budget).close()
    writers = [process.start([sys.executable, "-c", _WRITER.format(repo=str(REPO), root=str(root), budget=budget,
                                                                   n=150, seed=s)], name=f"disk writer {s}")
               for s in (1, 2)]
    peak, samples = 0, 0
    deadline = time.monotonic() + 120
    try:
        while any(w.alive() for w in writers) and time.monotonic() < deadline:
            peak = max(peak, _dir_bytes_locked(root))
            samples += 1
    finally:
        for w in writers:
            if w.alive():
                w.kill()
    logs = [w.tail() for w in writers]
    for w in writers:
        w.close()
    assert [w.proc.returncode for w in writers] == [0, 0], logs
    assert samples > 0
    # before: each process kept its own 10-chunk budget (the directory held ~2x), plus temp files
    assert peak <= budget, f"directory peaked at {peak} bytes, budget {budget}"
    assert _dir_bytes_locked(root) <= budget
    again = DiskBackend(root, byte_budget=budget)
    assert again.stats().bytes_used == _dir_bytes_locked(root)  # the shared accounting is exact
    assert again.stats().entries == 10


def test_a_replaced_state_file_is_rebuilt_from_a_recount(tmp_path: Path) -> None:
    one = disk_file_bytes(tmp_path / "probe", chunk(0))
    tier = DiskBackend(tmp_path / "d", byte_budget=3 * one + STATE_BYTES)
    tier.batched_put([(ckey(i), chunk(i)) for i in range(3)])
    with open(tmp_path / "d" / STATE_FILE, "r+b") as f:
        f.write(b"not a state file, garbage instead")
    tier.put(ckey(3), chunk(3))  # still evicts to stay within its budget
    assert _dir_bytes_locked(tmp_path / "d") <= 3 * one + STATE_BYTES
    assert tier.stats().bytes_used == _dir_bytes_locked(tmp_path / "d")
