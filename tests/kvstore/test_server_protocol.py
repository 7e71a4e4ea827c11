"""Frame encoding/decoding and the server's byte store and disk spill, without sockets."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.server import protocol as P
from kvstore.server.disk import DiskSpill
from kvstore.server.protocol import Op
from kvstore.server.store import ByteStore


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
    assert store.bytes_used == sum(len(k) + len(v) for k, v in store._lru.items())


def test_store_replacing_a_key_accounts_bytes_once() -> None:
    store = ByteStore(max_bytes=100)
    store.put(b"a", bytes(50))
    store.put(b"a", bytes(10))
    assert store.bytes_used == 11 and len(store) == 1
    assert store.delete(b"a") and not store.delete(b"a") and store.bytes_used == 0


def test_spill_and_promote(tmp_path) -> None:
    spill = DiskSpill(tmp_path, max_bytes=10_000)
    store = ByteStore(max_bytes=300, spill=spill)
    values = {f"k{i}".encode(): os.urandom(100) for i in range(8)}
    for k, v in values.items():
        store.put(k, v)
    assert store.bytes_used <= 300 and len(spill) == 6
    assert all(store.contains(k) for k in values)
    assert bytes(store.get(b"k0")) == values[b"k0"]  # from disk, promoted
    assert b"k0" not in spill and store.stats().disk_hits == 1
    assert store.prefix_hits(list(values)) == 8
    store.clear()
    assert len(store) == 0 and spill.bytes_used == 0 and not any(tmp_path.iterdir())


def test_spill_budget_counts_file_sizes(tmp_path) -> None:
    spill = DiskSpill(tmp_path, max_bytes=1000)
    for i in range(10):
        spill.put(f"k{i}".encode(), bytes(300))
        assert spill.bytes_used <= 1000
        assert spill.bytes_used == sum(p.stat().st_size for p in tmp_path.iterdir())
    assert len(spill) == 3 and spill.evictions == 7  # 20-byte header + key + value = 322 bytes a file
    assert not spill.put(b"big", bytes(2000))


def test_spill_survives_reopen_and_drops_damaged_files(tmp_path) -> None:
    spill = DiskSpill(tmp_path, max_bytes=1 << 20)
    spill.put(b"good", b"g" * 500)
    spill.put(b"bad", b"b" * 500)
    spill.put(b"short", b"s" * 500)
    (tmp_path / "junk.tmp").write_bytes(b"half a write")
    reopened = DiskSpill(tmp_path, max_bytes=1 << 20)
    assert len(reopened) == 3 and not (tmp_path / "junk.tmp").exists()
    # Flip a value byte: the CRC catches it and the entry becomes a miss, never wrong bytes.
    bad = next(p for p in tmp_path.iterdir() if p.read_bytes().endswith(b"b" * 500))
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(data)
    assert reopened.get(b"bad") is None and reopened.corrupt == 1 and b"bad" not in reopened
    assert bytes(reopened.get(b"good")) == b"g" * 500
    # A truncated file is dropped when the directory is scanned.
    short = next(p for p in tmp_path.iterdir() if p.read_bytes().endswith(b"s" * 500))
    short.write_bytes(short.read_bytes()[:-10])
    assert b"short" not in DiskSpill(tmp_path, max_bytes=1 << 20)


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
