"""Frame encoding/decoding and the server's byte store and disk spill, without sockets."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.cache_server import protocol as P
from kvstore.cache_server import spillfile as F
from kvstore.cache_server.protocol import Op
from kvstore.cache_server.spill import DiskSpill
from kvstore.cache_server.store import ByteStore


@pytest.fixture
def spills() -> Iterator[Callable[..., DiskSpill]]:
    """Returns DiskSpill's constructor; every spill made is closed (its two threads stopped)
    after the test, an assert failing included."""
    made: list[DiskSpill] = []

    def make(*args: Any, **kw: Any) -> DiskSpill:
        made.append(DiskSpill(*args, **kw))
        return made[-1]

    yield make
    for spill in made:
        spill.close()


def test_header_round_trip() -> None:
    raw = P.encode_header(Op.PUT, 7, 12, 5_000_000, flags=0)
    assert len(raw) == P.HEADER_SIZE == 24
    h = P.decode_header(raw, max_payload=8 << 20)
    assert (h.code, h.request_id, h.key_len, h.payload_len, h.body_len) == (Op.PUT, 7, 12, 5_000_000, 5_000_012)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[:24], "bad magic"),
        (b"KVTS" + bytes([9]) + P.encode_header(Op.PING, 0, 0, 0)[5:], "unsupported protocol version 9"),
        (P.encode_header(Op.GET, 0, P.MAX_KEY_LEN + 1, 0), "key length 4097"),
        (P.encode_header(Op.PUT, 0, 1, 1025), "payload length 1025 exceeds the limit of 1024"),
    ],
)
def test_bad_headers_name_the_problem(raw: bytes, message: str) -> None:
    with pytest.raises(P.ProtocolError, match=message):
        P.decode_header(raw, max_payload=1024)


@given(st.lists(st.binary(max_size=64), max_size=50))
def test_key_list_round_trip(keys: list[bytes]) -> None:
    assert P.decode_key_list(P.encode_key_list(keys)) == keys


@pytest.mark.parametrize("payload", [b"\x05\x00\x00", b"\x05\x00\x00\x00abc", b"\xff\xff\xff\xff" + b"x" * 10])
def test_malformed_key_list_is_an_error(payload: bytes) -> None:
    with pytest.raises(P.ProtocolError):
        P.decode_key_list(payload)


def test_store_never_exceeds_budget_and_evicts_lru() -> None:
    store = ByteStore(max_bytes=1000)
    for i in range(10):
        assert store.put(f"k{i}".encode(), bytes(200))  # 202 bytes each: 4 fit
        assert store.bytes_used <= 1000
    assert store.get(b"k6") is not None  # k6 becomes most recent
    store.put(b"new", bytes(200))
    assert store.contains(b"k6") and not store.contains(b"k7")
    assert store.prefix_hits([b"k6", b"new", b"k7", b"k9"]) == 2
    s = store.stats()
    assert s.entries == 4 and s.bytes == 4 * 202 + 1 and s.evictions == 7
    assert not store.put(b"huge", bytes(1000)) and store.stats().rejected == 1
    assert store.bytes_used == sum(len(k) + len(v) for k, v in store._values.items())


def test_store_replacing_a_key_accounts_bytes_once() -> None:
    store = ByteStore(max_bytes=100)
    store.put(b"a", bytes(50))
    store.put(b"a", bytes(10))
    assert store.bytes_used == 11 and len(store) == 1
    assert store.delete(b"a") and not store.delete(b"a") and store.bytes_used == 0


def _put(store: ByteStore, key: bytes, value: bytes) -> None:
    """Stores `value`, waiting (as the server does) for queued spill writes to free room."""
    if not store.put(key, value):
        assert store.spill is not None and store.spill.worker.pending
        store.spill.flush()
        assert store.put(key, value)


def _load(store: ByteStore, key: bytes):
    """Returns what a GET of `key` gets: from memory, or read back from the disk spill."""
    value = store.get(key)
    if value is not None:
        return value
    got: list = []
    if not store.load(key, got.append):
        return None
    assert store.spill is not None
    while not got:  # the server retries when spill writes free memory; so do we
        store.spill.flush()
        store.retry_loads()
    return got[0]


def _read(spill: DiskSpill, key: bytes):
    got: list = []
    spill.detach(key)
    assert spill.read(key, got.append)
    spill.flush()
    return got[0]


def test_a_closed_spill_closes_again_and_flushes_without_blocking(tmp_path, spills) -> None:
    spill = DiskSpill(tmp_path, max_bytes=10_000)
    written: list[bool] = []
    spill.put(b"k", bytes(100), written.append)
    assert spill.close() and written == [True]
    assert spill.close()  # a second close (an owner's and a fixture's) returns at once
    spill.flush()
    assert b"k" in spills(tmp_path, max_bytes=10_000)


def test_spill_and_promote(tmp_path, spills) -> None:
    spill = spills(tmp_path, max_bytes=10_000)
    store = ByteStore(max_bytes=300, spill=spill)
    values = {f"k{i}".encode(): os.urandom(100) for i in range(8)}
    for k, v in values.items():
        _put(store, k, v)
        assert store.committed <= 300
    spill.flush()
    assert store.bytes_used <= 300 and len(spill) == 6 and store.spilling == store.retired == 0
    assert all(store.contains(k) for k in values)
    assert bytes(_load(store, b"k0")) == values[b"k0"]  # from disk, promoted
    assert b"k0" not in spill and store.stats().disk_hits == 1
    assert store.prefix_hits(list(values)) == 8
    store.clear()
    spill.flush()
    spill.janitor.drain()  # the cleared generation is removed in the background
    assert len(store) == 0 and spill.bytes_used == 0 and list(tmp_path.rglob("*.kvs")) == []
    assert [p.name for p in tmp_path.iterdir()] == ["gen-1"]


def test_a_value_being_spilled_is_answered_from_memory(tmp_path, spills) -> None:
    spill = spills(tmp_path, max_bytes=10_000)
    store = ByteStore(max_bytes=250, spill=spill)
    a, b = os.urandom(200), os.urandom(200)
    store.put(b"a", a)
    assert not store.put(b"b", b)  # a is queued for the disk: its bytes stay counted
    assert store.committed <= 250 and store.spilling == 201 and b"a" in spill
    assert bytes(store.get(b"a")) == a  # taken back before (or after) the write: never lost
    assert store.spilling == 0 and b"a" not in spill and store.bytes_used == 201
    spill.flush()  # the write's hold ends; a file written meanwhile is removed
    assert store.retired == store.pinned_stored == 0 and list(spill.dir.iterdir()) == []
    assert store.put(b"b", b) is False  # evicts a again: room comes once it is written
    spill.flush()
    assert store.put(b"b", b) and bytes(_load(store, b"a")) == a


def test_spill_budget_counts_file_sizes(tmp_path, spills) -> None:
    spill = spills(tmp_path, max_bytes=1000)
    written: list[bool] = []
    for i in range(10):
        spill.put(f"k{i}".encode(), bytes(300), written.append)
        assert spill.bytes_used <= 1000
        spill.flush()
        assert spill.bytes_used == sum(p.stat().st_size for p in spill.dir.iterdir())
    assert len(spill) == 3 and spill.evictions == 7  # 20-byte header + key + value = 322 bytes a file
    assert not spill.put(b"big", bytes(2000), written.append)
    assert written == [True] * 10


def test_spill_survives_reopen_and_drops_damaged_files(tmp_path, spills) -> None:
    spill = spills(tmp_path, max_bytes=1 << 20)
    for key, byte in ((b"good", b"g"), (b"bad", b"b"), (b"short", b"s")):
        spill.put(key, byte * 500, lambda ok: None)
    spill.close()
    (spill.dir / "junk.kvs.tmp").write_bytes(b"half a write")
    reopened = spills(tmp_path, max_bytes=1 << 20)
    assert len(reopened) == 3 and not (spill.dir / "junk.kvs.tmp").exists()
    # Flip a value byte: the CRC catches it and the entry becomes a miss, never wrong bytes.
    bad = next(p for p in reopened.dir.iterdir() if p.read_bytes().endswith(b"b" * 500))
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(data)
    assert _read(reopened, b"bad") is None and reopened.corrupt == 1 and b"bad" not in reopened
    assert bytes(_read(reopened, b"good")) == b"g" * 500 and not bad.exists()
    # A truncated file is dropped when the directory is scanned.
    short = next(p for p in reopened.dir.iterdir() if p.read_bytes().endswith(b"s" * 500))
    short.write_bytes(short.read_bytes()[:-10])
    assert b"short" not in spills(tmp_path, max_bytes=1 << 20)


def test_restart_reuses_the_newest_generation_and_removes_older_ones(tmp_path, spills) -> None:
    spill = spills(tmp_path, max_bytes=1 << 20)
    spill.put(b"old", b"o" * 100, lambda ok: None)
    spill.clear()  # gen-1 is live; gen-0 goes in the background
    spill.put(b"new", b"n" * 100, lambda ok: None)
    spill.close()
    (tmp_path / "gen-0").mkdir(exist_ok=True)  # as if a crash cut the removal short
    (tmp_path / "gen-0" / "x.kvs").write_bytes(b"left over")
    reopened = spills(tmp_path, max_bytes=1 << 20)
    reopened.janitor.drain()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gen-1"]
    assert b"new" in reopened and b"old" not in reopened
    assert bytes(_read(reopened, b"new")) == b"n" * 100


def test_clear_that_cannot_switch_directories_removes_the_files_one_by_one(tmp_path, spills) -> None:
    spill = spills(tmp_path, max_bytes=1 << 20)
    for i in range(5):
        spill.put(f"k{i}".encode(), bytes(100), lambda ok: None)
    spill.flush()
    (tmp_path / "gen-1").write_bytes(b"")  # the next generation cannot be made
    spill.clear()
    assert len(spill) == 0 and spill.bytes_used == 0 and spill.write_failures == 1
    spill.put(b"new", b"n" * 10, lambda ok: None)
    spill.flush()
    assert [p.name for p in spill.dir.iterdir()] == [spill.dir.joinpath(F.file_name(b"new")).name]
    assert bytes(_read(spill, b"new")) == b"n" * 10


def test_invalid_budgets_are_value_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        ByteStore(0)
    with pytest.raises(ValueError, match="max_disk_bytes"):
        DiskSpill(tmp_path, 0)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["put", "reserve", "store_reserved", "release", "get_pin", "unpin", "delete"]),
            st.integers(0, 5),
            st.integers(1, 400),
        ),
        max_size=80,
    )
)
def test_store_ledger_never_exceeds_budget(ops: list[tuple[str, int, int]]) -> None:
    """Stored entries, reserved bodies and values being sent (pinned, maybe evicted) are one
    budget: whatever the order of operations, committed bytes never exceed it."""
    store = ByteStore(max_bytes=1000)
    reservations: list[int] = []
    pinned: list = []
    for op, k, n in ops:
        key = f"k{k}".encode()
        if op == "put":
            store.put(key, bytes(n))
        elif op == "reserve" and store.reserve(n):
            reservations.append(n)
        elif op == "store_reserved" and reservations:
            size = reservations.pop()
            assert store.put(key, bytes(max(0, size - len(key))), reserved=size) or size < len(key)
        elif op == "release" and reservations:
            store.release(reservations.pop())
        elif op == "get_pin":
            value = store.get(key)
            if value is not None:
                store.pin(key, value)
                pinned.append(value)
        elif op == "unpin" and pinned:
            store.unpin(pinned.pop(0))
        elif op == "delete":
            store.delete(key)
        assert 0 <= store.committed <= store.max_bytes
        assert store.reserved == sum(reservations)
    for value in pinned:
        store.unpin(value)
    assert store.retired == 0 and store.pinned_stored == 0


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["put", "reserve", "release", "get_pin", "unpin", "load", "flush", "delete", "clear"]),
            st.integers(0, 5),
            st.integers(1, 400),
        ),
        max_size=60,
    )
)
def test_store_ledger_with_a_spill_never_exceeds_budget(ops: list[tuple[str, int, int]]) -> None:
    """With a disk spill, values queued for writing stay in the one budget until written, a
    GET meanwhile gets them from memory, and every hold returns to zero."""
    with tempfile.TemporaryDirectory() as root:
        spill = DiskSpill(root, max_bytes=2000)
        store = ByteStore(max_bytes=1000, spill=spill)
        values: dict[bytes, bytes] = {}
        reservations: list[int] = []
        pinned: list = []
        loaded: list = []
        try:
            _apply(ops, store, spill, values, reservations, pinned, loaded)
        finally:
            spill.close()
        for key, value in loaded:
            assert value is None or bytes(value) == bytes([int(key[1:])]) * len(value)
        assert store.reserved == sum(reservations) and store.spilling == 0
        assert store.retired == 0 and store.pinned_stored == 0 and store.loads_waiting == 0


def _apply(ops: list[tuple[str, int, int]], store: ByteStore, spill: DiskSpill, values: dict[bytes, bytes],
           reservations: list[int], pinned: list, loaded: list) -> None:
    """Runs `ops` on `store`, checking the one-budget rule after each; then returns every
    pinned value and settles the spill's writes and the loads waiting for them."""
    for op, k, n in ops:
        key = f"k{k}".encode()
        if op == "put":
            value = bytes([k]) * n
            if store.put(key, value):
                values[key] = value
            else:
                values.pop(key, None)  # refused (waiting for spill writes): the old value is gone
        elif op == "reserve" and store.reserve(n):
            reservations.append(n)
        elif op == "release" and reservations:
            store.release(reservations.pop())
        elif op == "get_pin":
            value = store.get(key)
            if value is not None:
                assert bytes(value) == values[key]
                store.pin(key, value)
                pinned.append(value)
        elif op == "unpin" and pinned:
            store.unpin(pinned.pop(0))
        elif op == "load" and store.get(key) is None:
            store.load(key, lambda v, key=key: loaded.append((key, v)))
        elif op == "flush":
            spill.flush()
            store.retry_loads()
        elif op == "delete":
            store.delete(key)
            values.pop(key, None)
        elif op == "clear":
            store.clear()
            values.clear()
        assert 0 <= store.committed <= store.max_bytes
        assert store.reserved - sum(reservations) >= 0  # the rest: disk reads in flight
    for value in pinned:
        store.unpin(value)
    for _ in range(3):
        spill.flush()
        store.retry_loads()
