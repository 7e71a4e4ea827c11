"""--auth-token: a missing or wrong token is refused before anything is read or stored."""

from __future__ import annotations

import os

import pytest

from harness.cache_server import CacheServerProcess
from kvstore.backends.server_client import CacheServerClient, ServerReplyError
from kvstore.cache_server import protocol as P
from kvstore.cache_server.protocol import Op, Status
from tests.fixtures.cache_server import raw_exchange

TOKEN = "s3cret-token"


@pytest.fixture
def server(cache_server_factory: type[CacheServerProcess]) -> CacheServerProcess:
    return cache_server_factory("--auth-token", TOKEN)


def _status(data: bytes) -> int:
    return P.decode_header(data, max_payload=1 << 20).code


def test_right_token_works(server: CacheServerProcess) -> None:
    c = CacheServerClient("127.0.0.1", server.port, auth_token=TOKEN)
    value = os.urandom(3 << 20)
    assert c.put(b"k", value) and c.get(b"k") == value and c.prefix_hits([b"k"]) == 1
    c.close()


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", TOKEN[:-1]])
def test_missing_or_wrong_token_is_refused(server: CacheServerProcess, token: str | None) -> None:
    c = CacheServerClient("127.0.0.1", server.port, auth_token=token)
    with pytest.raises(ServerReplyError) as info:
        c.put(b"intruder", b"x")
    assert info.value.status == (Status.AUTH_REQUIRED if token is None else Status.AUTH_FAILED)
    good = CacheServerClient("127.0.0.1", server.port, auth_token=TOKEN)
    assert not good.exists(b"intruder")  # nothing was stored
    good.close()


def test_unauthenticated_frames_get_a_refusal_and_a_close(server: CacheServerProcess) -> None:
    # Requests pipelined behind the refused one are never executed.
    data = raw_exchange(server.port, P.encode_frame(Op.PUT, 1, b"a", b"v") + P.encode_frame(Op.STATS, 2))
    assert (
        _status(data) == Status.AUTH_REQUIRED
        and len(data) == P.HEADER_SIZE + P.decode_header(data, 1 << 20).payload_len
    )
    data = raw_exchange(server.port, P.encode_frame(Op.AUTH, 1, payload=b"nope") + P.encode_frame(Op.STATS, 2))
    assert _status(data) == Status.AUTH_FAILED and b"wrong auth token" in data
    # Before auth, a frame may not announce a large body (no memory for strangers).
    data = raw_exchange(server.port, P.encode_header(Op.PUT, 1, 1, 10 << 20))
    assert data == b"" or _status(data) == Status.BAD_FRAME
    good = CacheServerClient("127.0.0.1", server.port, auth_token=TOKEN)
    assert not good.exists(b"a") and good.ping()
    good.close()


def test_token_from_environment(cache_server_factory: type[CacheServerProcess], monkeypatch) -> None:
    monkeypatch.setenv("KVTIER_AUTH_TOKEN", "from-env")
    server = cache_server_factory()
    assert CacheServerClient("127.0.0.1", server.port, auth_token="from-env").ping()
    with pytest.raises(ServerReplyError):
        CacheServerClient("127.0.0.1", server.port).ping()


def test_empty_token_is_an_error(cache_server_factory: type[CacheServerProcess], monkeypatch) -> None:
    # An empty token would mean "no auth" without anyone having asked for that.
    monkeypatch.setenv("KVTIER_AUTH_TOKEN", "from-env")
    with pytest.raises(RuntimeError, match="--auth-token is empty"):
        cache_server_factory("--auth-token", "")
    monkeypatch.setenv("KVTIER_AUTH_TOKEN", "")
    with pytest.raises(RuntimeError, match=r"\$KVTIER_AUTH_TOKEN is empty"):
        cache_server_factory()


def test_a_failed_auth_closes_even_after_a_good_one(server: CacheServerProcess) -> None:
    frames = (P.encode_frame(Op.AUTH, 1, payload=TOKEN.encode()) + P.encode_frame(Op.AUTH, 2, payload=b"guess")
              + P.encode_frame(Op.PING, 3))
    data = raw_exchange(server.port, frames)
    first = P.decode_header(data, 1 << 20)
    second = P.decode_header(data, 1 << 20, P.HEADER_SIZE + first.payload_len)
    assert (first.code, first.request_id) == (Status.OK, 1)
    assert (second.code, second.request_id) == (Status.AUTH_FAILED, 2)
    assert len(data) == 2 * P.HEADER_SIZE + first.payload_len + second.payload_len  # no PONG: closed
