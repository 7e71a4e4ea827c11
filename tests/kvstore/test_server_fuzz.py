"""Malformed input: each case gets an error reply or a closed connection, and the server keeps
serving everyone else (checked through a client that stays connected throughout)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.cache_server import CacheServerProcess
from kvstore.backends.server_client import CacheServerClient
from kvstore.cache_server import protocol as P
from kvstore.cache_server.protocol import Op, Status
from tests.fixtures.cache_server import raw_exchange

MAX_PAYLOAD = 1 << 20
VALUE = os.urandom(200_000)


@pytest.fixture(scope="module")
def server() -> Iterator[CacheServerProcess]:
    proc = CacheServerProcess("--max-bytes", "64MiB", "--max-payload", str(MAX_PAYLOAD))
    yield proc
    assert proc.stop() == 0  # still alive and stops cleanly after all the abuse


@pytest.fixture(scope="module")
def witness(server: CacheServerProcess) -> Iterator[CacheServerClient]:
    """A well-behaved client holding data; every test checks it is still served."""
    c = CacheServerClient("127.0.0.1", server.port)
    assert c.put(b"witness", VALUE)
    yield c
    c.close()


def _replies(data: bytes) -> list[tuple[int, int, bytes]]:
    """Parses the server's reply stream; fails if the server ever sends a malformed frame."""
    out = []
    while data:
        h = P.decode_header(data, max_payload=1 << 40)
        assert h.key_len == 0 and len(data) >= P.HEADER_SIZE + h.payload_len
        out.append((h.code, h.request_id, data[P.HEADER_SIZE : P.HEADER_SIZE + h.payload_len]))
        data = data[P.HEADER_SIZE + h.payload_len :]
    return out


def _still_serving(witness: CacheServerClient) -> None:
    assert witness.get(b"witness") == VALUE
    other = CacheServerClient("127.0.0.1", witness.port)
    assert other.ping() and other.exists(b"witness")
    other.close()


@pytest.mark.parametrize(
    ("name", "data", "status", "message"),
    [
        ("bad magic", b"XXXX" + P.encode_frame(Op.PING, 1)[4:], Status.BAD_FRAME, b"bad magic"),
        ("http", b"GET /stats HTTP/1.1\r\nHost: localhost\r\n\r\n", Status.BAD_FRAME, b"bad magic"),
        ("bad version", P.MAGIC + b"\x07" + P.encode_frame(Op.PING, 1)[5:], Status.BAD_FRAME, b"version 7"),
        ("payload over --max-payload", P.encode_header(Op.PUT, 1, 1, MAX_PAYLOAD + 1) + b"k" + b"x" * 1000,
         Status.BAD_FRAME, b"exceeds the limit of 1048576"),
        ("key too long", P.encode_header(Op.GET, 1, P.MAX_KEY_LEN + 1, 0), Status.BAD_FRAME, b"key length"),
        ("garbage", bytes(range(256)) * 40, Status.BAD_FRAME, b"bad magic"),
    ],
)
def test_framing_errors_get_an_error_reply_and_a_close(
    server: CacheServerProcess, witness: CacheServerClient, name: str, data: bytes, status: Status, message: bytes
) -> None:
    replies = _replies(raw_exchange(server.port, data))
    # An error reply may be lost if the server closes while our bytes are unread (TCP RST);
    # a closed connection alone is an accepted answer, a wrong reply is not.
    assert len(replies) <= 1
    if replies:
        assert replies[0][0] == status and message in replies[0][2], (name, replies)
    _still_serving(witness)


def test_unknown_op_is_refused_and_the_connection_stays_usable(server: CacheServerProcess, witness) -> None:
    data = (P.encode_frame(200, 1, b"key", b"payload" * 1000)
            + P.encode_header(201, 2, 0, 300_000) + bytes(300_000)  # a body larger than the receive buffer
            + P.encode_frame(Op.GET, 3, b"witness"))
    replies = _replies(raw_exchange(server.port, data))
    assert [(s, rid) for s, rid, _ in replies] == [(Status.UNKNOWN_OP, 1), (Status.UNKNOWN_OP, 2), (Status.OK, 3)]
    assert b"unknown op 200" in replies[0][2] and replies[2][2] == VALUE
    _still_serving(witness)


def test_malformed_prefix_hits_payload_is_a_bad_request(server: CacheServerProcess, witness) -> None:
    data = P.encode_frame(Op.PREFIX_HITS, 1, payload=b"\x09\x00\x00\x00abc") + P.encode_frame(Op.PING, 2)
    replies = _replies(raw_exchange(server.port, data))
    assert [(s, rid) for s, rid, _ in replies] == [(Status.BAD_REQUEST, 1), (Status.OK, 2)]
    _still_serving(witness)


@pytest.mark.parametrize("cut", [3, P.HEADER_SIZE, P.HEADER_SIZE + 2, P.HEADER_SIZE + 5 + 70_000])
def test_truncated_frames_are_dropped(server: CacheServerProcess, witness, cut: int) -> None:
    frame = P.encode_frame(Op.PUT, 1, b"trunc", os.urandom(100_000))
    assert raw_exchange(server.port, frame[:cut]) == b""  # no reply to half a request
    _still_serving(witness)
    assert not witness.exists(b"trunc")  # nothing half-stored


def test_abrupt_disconnect_mid_reply(server: CacheServerProcess, witness) -> None:
    # Ask for a large value many times and vanish without reading: the server must cope.
    for _ in range(5):
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(P.encode_frame(Op.GET, 1, b"witness") * 20)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()  # RST
    _still_serving(witness)


_valid_frames = st.builds(
    lambda op, rid, key, payload: P.encode_frame(op, rid, key, payload),
    st.sampled_from([*Op, 0, 10, 255]),
    st.integers(0, 2**32 - 1),
    st.binary(max_size=40),
    st.binary(max_size=300),
)


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    """Valid frames, then random byte flips, cuts and garbage."""
    data = bytearray(b"".join(draw(st.lists(_valid_frames, min_size=1, max_size=4))))
    for _ in range(draw(st.integers(0, 4))):
        pos = draw(st.integers(0, len(data) - 1))
        data[pos] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data) + draw(st.binary(max_size=64))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(_mutated(), st.binary(max_size=2000)))
def test_fuzzed_frames_never_break_the_server(server: CacheServerProcess, witness, data: bytes) -> None:
    replies = _replies(raw_exchange(server.port, data))  # every reply well-formed
    for status, _, _ in replies:
        assert status in set(Status)
    # Fuzzed frames may legitimately CLEAR or DELETE, so check service with a fresh value.
    probe = os.urandom(1000)
    assert witness.put(b"probe", probe) and witness.get(b"probe") == probe
