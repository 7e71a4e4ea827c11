"""Operator pins of the disk tier are the directory's (kvstore/pin_file.py, `.kvtier-pins`): they
survive a restart, a second process sharing the directory never evicts a chunk pinned by the
first and counts its pins in the pin budget, unpin, expiry and removals by any process update
them, and a corrupt or foreign pin file is ignored with a warning (never executed)."""

from __future__ import annotations

import json
import logging
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import process
from harness.process import repo_env
from kvkeys.tenants import tenant_prefix
from kvstore.backends.disk import STATE_BYTES, DiskBackend
from kvstore.pin_file import PIN_FILE
from kvstore.pin_set import PinError
from tests.fixtures.tiers import chunk, ckey, disk_file_bytes

REPO = Path(__file__).resolve().parents[2]
TAG = "00000000000ac0e0"  # a tenant tag: 16 lowercase hex digits


def sizes(tmp_path: Path) -> tuple[int, int, int]:
    """Returns (one chunk file's bytes, a byte budget of 4 such files, a pin budget of 2)."""
    one = disk_file_bytes(tmp_path / "probe", chunk(0))
    return one, 4 * one + STATE_BYTES, 2 * one


def pins_now(tier: DiskBackend) -> tuple[int, int]:
    s = tier.stats()
    assert s.pin_budget is None or s.pinned_bytes <= s.pin_budget
    return s.pinned_entries, s.pinned_bytes


def test_pins_survive_a_restart_and_keep_their_chunks(tmp_path: Path) -> None:
    one, budget, pin_budget = sizes(tmp_path)
    tier = DiskBackend(tmp_path / "d", byte_budget=budget, pin_budget=pin_budget)
    tier.batched_put([(ckey(i), chunk(i)) for i in range(3)])
    tier.pin([ckey(0)])
    tier.pin([ckey(1)], ttl_s=3600)
    root = tmp_path / "d"
    assert tier.stats().bytes_used == sum(p.stat().st_size for p in root.iterdir())  # the pin file counts
    tier.close()

    again = DiskBackend(tmp_path / "d", byte_budget=budget, pin_budget=pin_budget)  # the restart
    assert pins_now(again) == (2, 2 * one)
    info = again.describe([ckey(0), ckey(1), ckey(2)])
    assert [i is not None and i.pinned for i in info] == [True, True, False]
    assert info[0] is not None and info[0].pin_expires_in_s is None
    assert info[1] is not None and info[1].pin_expires_in_s is not None and 0 < info[1].pin_expires_in_s <= 3600
    again.batched_put([(ckey(100 + i), chunk(100 + i)) for i in range(10)])  # a flood evicts the rest
    assert again.batched_contains([ckey(0), ckey(1), ckey(2)]) == [True, True, False]
    assert again.unpin([ckey(0), ckey(1)]) == 2 and pins_now(again) == (0, 0)
    again.close()
    third = DiskBackend(tmp_path / "d", byte_budget=budget, pin_budget=pin_budget)
    assert pins_now(third) == (0, 0)  # the unpin was kept too
    third.close()


_OTHER = """
import json, sys
sys.path.insert(0, {repo!r})
from kvstore.backends.disk import DiskBackend
from kvstore.pin_set import PinError
from tests.fixtures.tiers import chunk, ckey
tier = DiskBackend({root!r}, byte_budget={budget}, pin_budget={pin_budget})
print("ready", flush=True)
for step in sys.stdin:
    step = step.strip()
    out = {{}}
    if step == "flood":
        tier.batched_put([(ckey(1000 + i), chunk(1000 + i)) for i in range(8)])
        out["held"] = tier.batched_contains([ckey(0), ckey(1)])
    elif step == "pin":
        try:
            tier.pin([ckey(1000 + 6), ckey(1000 + 7)])
            out["two"] = "pinned"
        except PinError as exc:
            out["two"] = str(exc)
        out["one"] = tier.pin([ckey(1000 + 7)])
    s = tier.stats()
    out["pins"] = [s.pinned_entries, s.pinned_bytes, s.pin_budget]
    print(json.dumps(out), flush=True)
"""


def test_a_second_process_never_evicts_a_chunk_pinned_by_the_first(tmp_path: Path) -> None:
    one, budget, pin_budget = sizes(tmp_path)
    root = tmp_path / "shared"
    here = DiskBackend(root, byte_budget=budget, pin_budget=pin_budget)
    here.batched_put([(ckey(0), chunk(0)), (ckey(1), chunk(1))])
    other = process.popen(
        [sys.executable, "-c", _OTHER.format(repo=str(REPO), root=str(root), budget=budget, pin_budget=pin_budget)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=repo_env())
    assert other.stdin is not None and other.stdout is not None

    def ask(step: str) -> dict[str, object]:
        assert other.stdin is not None and other.stdout is not None
        other.stdin.write(step + "\n")
        other.stdin.flush()
        return json.loads(other.stdout.readline())

    try:
        assert other.stdout.readline().strip() == "ready"  # it opened the directory before the pin
        here.pin([ckey(0)])
        got = ask("flood")  # it re-reads the pins before evicting: ckey(0) stays, ckey(1) goes
        assert got == {"held": [True, False], "pins": [1, one, pin_budget]}
        got = ask("pin")  # one pinned here + two more would pass the pin budget: refused whole
        assert "pin budget" in str(got["two"]) and got["one"] == one
        assert got["pins"] == [2, 2 * one, pin_budget]
        assert pins_now(here) == (2, 2 * one)  # its pin is seen here too
        with pytest.raises(PinError, match="pin budget"):
            here.pin([ckey(1000 + 6)])
        assert here.unpin([ckey(0), ckey(1000 + 7)]) == 2  # any process releases any pin
        assert pins_now(here) == (0, 0)
        got = ask("flood")
        assert got == {"held": [False, False], "pins": [0, 0, pin_budget]}
    finally:
        other.stdin.close()
        assert other.wait(timeout=30) == 0
        other.stdout.close()
    here.close()


def test_removal_and_expiry_in_one_process_release_the_pin_in_the_other(tmp_path: Path) -> None:
    one, budget, pin_budget = sizes(tmp_path)
    salted = [f"{tenant_prefix(TAG)}{ckey(i)}" for i in range(2)]
    a = DiskBackend(tmp_path / "d", byte_budget=budget, pin_budget=3 * one)
    b = DiskBackend(tmp_path / "d", byte_budget=budget, pin_budget=3 * one)  # its own flock: a second user
    a.batched_put([(ckey(0), chunk(0)), (salted[0], chunk(1)), (salted[1], chunk(2))])
    a.pin([ckey(0)], ttl_s=1.0)  # long enough to still hold two calls later on a loaded host
    a.pin(salted)
    assert pins_now(b) == (3, 3 * one)
    assert b.delete_prefix(tenant_prefix(TAG)) == 2  # forgetting a tenant beats its pins
    time.sleep(1.1)  # ckey(0)'s pin expires
    assert pins_now(a) == (0, 0) and pins_now(b) == (0, 0)
    b.put(ckey(5), chunk(5))  # b's next change writes the pin file without the expired pin
    doc = json.loads((tmp_path / "d" / PIN_FILE).read_bytes())
    assert doc["pins"] == {} and doc["version"] == 1
    a.close()
    b.close()


_EXECUTED = "/nonexistent"  # replaced per test: a file a pickle would create if it ran


class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (open, (_EXECUTED, "w"))


@pytest.mark.parametrize("content", ["garbage", "pickle", "foreign", "version", "over budget"])
def test_a_corrupt_or_foreign_pin_file_is_ignored_with_a_warning(tmp_path: Path, content: str,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    global _EXECUTED
    one, budget, pin_budget = sizes(tmp_path)
    root = tmp_path / "d"
    tier = DiskBackend(root, byte_budget=budget, pin_budget=pin_budget)
    tier.batched_put([(ckey(0), chunk(0))])
    tier.close()
    _EXECUTED = str(tmp_path / "executed")
    body = {
        "garbage": b"\x00\xffnot json",
        "pickle": pickle.dumps(_Boom()),
        "foreign": json.dumps({"kind": "something-else", "version": 1, "pins": {}}).encode(),
        "version": json.dumps({"kind": "kvtier-pins", "version": 2, "budget": None,
                               "pins": {ckey(0): [one, None]}}).encode(),
        "over budget": json.dumps({"kind": "kvtier-pins", "version": 1, "budget": 1,
                                   "pins": {ckey(0): [one, None]}}).encode(),
    }[content]
    (root / PIN_FILE).write_bytes(body)
    with caplog.at_level(logging.WARNING, logger="kvstore.pin_file"):
        tier = DiskBackend(root, byte_budget=budget, pin_budget=pin_budget)
    assert any("ignored" in r.getMessage() for r in caplog.records)
    assert pins_now(tier) == (0, 0) and not (tmp_path / "executed").exists()
    assert tier.get(ckey(0)) is not None  # the data is untouched
    tier.pin([ckey(0)])  # the next pin replaces the file with a valid one
    doc = json.loads((root / PIN_FILE).read_bytes())
    assert doc["kind"] == "kvtier-pins" and list(doc["pins"]) == [ckey(0)]
    tier.close()


def test_a_lowered_pin_budget_releases_pins_at_open(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    one, budget, pin_budget = sizes(tmp_path)
    tier = DiskBackend(tmp_path / "d", byte_budget=budget, pin_budget=pin_budget)
    tier.batched_put([(ckey(0), chunk(0)), (ckey(1), chunk(1))])
    tier.pin([ckey(0), ckey(1)])
    tier.close()
    with caplog.at_level(logging.WARNING):
        smaller = DiskBackend(tmp_path / "d", byte_budget=budget, pin_budget=one)
    assert pins_now(smaller) == (1, one) and "released 1 pin" in caplog.text
    assert smaller.stats().pin_budget == one
    smaller.close()
