"""--tenant-tokens against a real `kvtier cache-server` process: a client holding tenant A's
token can neither read, write, probe (EXISTS, PREFIX_HITS), list nor delete tenant B's entries
(nor unsalted ones, nor CLEAR); the operator's --auth-token still may do anything; a wrong
token is refused; refusals are FORBIDDEN on an open connection, counted in STATS."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.cache_server import CacheServerProcess
from kvkeys.tenants import tenant_prefix, tenant_tag
from kvstore.backend import leading_run
from kvstore.backends.cache_server_tier import CacheServerBackend
from kvstore.backends.server_client import CacheServerClient, ServerReplyError
from kvstore.cache_server import protocol as P
from kvstore.cache_server.protocol import Op, Status
from kvstore.registry import create_backend
from kvstore.store_config import TierSpec
from kvtier.cmd_cache_server import load_tenant_tokens
from tests.fixtures.cache_server import raw_exchange

OPERATOR, TOKEN_A, TOKEN_B = "operator-token", "token-of-tenant-a", "token-of-tenant-b"
TAG_KEY = "operator secret, 32 bytes long.."
TAG_A = "0123456789abcdef"
TAG_B = tenant_tag("salt-of-b", TAG_KEY)  # B's entry names its salt: the server tags it with the key
A, B = tenant_prefix(TAG_A).encode(), tenant_prefix(TAG_B).encode()
UNSALTED = b"kvtier:m0:float16:v1:c4:00ff"


@pytest.fixture
def server(cache_server_factory: type[CacheServerProcess], tmp_path: Path, monkeypatch) -> CacheServerProcess:
    tokens = tmp_path / "tenants.json"
    tokens.write_text(json.dumps({TOKEN_A: TAG_A, TOKEN_B: {"cache_salt": "salt-of-b"}}))
    monkeypatch.setenv("KVTIER_TENANT_TAG_KEY", TAG_KEY)
    return cache_server_factory("--auth-token", OPERATOR, "--tenant-tokens", str(tokens), "--max-bytes", "64MiB")


def _client(server: CacheServerProcess, token: str | None) -> CacheServerClient:
    return CacheServerClient("127.0.0.1", server.port, auth_token=token)


def _refused(call, *args) -> None:
    with pytest.raises(ServerReplyError) as info:
        call(*args)
    assert info.value.status == Status.FORBIDDEN


def test_a_tenant_token_touches_only_its_tenant(server: CacheServerProcess) -> None:
    op, a, b = (_client(server, t) for t in (OPERATOR, TOKEN_A, TOKEN_B))
    big = bytes(range(256)) * 1024  # 256 KiB: received into its own reserved buffer
    assert op.put(UNSALTED, b"shared") and b.put(B + b"k1", b"b1") and b.put(B + b"big", big)
    assert a.put(A + b"k1", b"a1")
    # A cannot read, probe, overwrite or remove B's entries, nor unsalted ones.
    for key in (B + b"k1", B + b"big", UNSALTED):
        assert a.get(key) is None and not a.exists(key) and a.prefix_hits([key]) == 0
        assert not a.put(key, b"forged") and not a.put(key, big)
        _refused(a.delete, key)
    assert a.prefix_hits([A + b"k1", B + b"k1"]) == 0  # one key outside A refuses the whole list
    for prefix in (B, b"kvtier:", b"kvtier:tenant-", A[:-1]):
        _refused(a.delete_prefix, prefix)
    _refused(a.clear)
    # B's entries and the unsalted one are untouched; A's own work as before.
    assert op.get(B + b"k1") == b"b1" and op.get(B + b"big") == big and op.get(UNSALTED) == b"shared"
    assert b.get(B + b"k1") == b"b1" and b.get(A + b"k1") is None
    assert a.get(A + b"k1") == b"a1" and a.exists(A + b"k1") and a.prefix_hits([A + b"k1"]) == 1
    assert a.ping() and a.reconnects == 0  # every refusal left the connection open
    stats = a.stats()  # STATS is open to tenants: totals only, no key
    # the client counts the refusals it answered as misses or unstored; DELETE, DELETE_PREFIX and CLEAR raised
    assert a.forbidden == 16 and b.forbidden == 1 and stats["forbidden"] == 16 + 3 + 4 + 1 + 1
    assert stats["reserved_bytes"] == 0  # the refused large PUTs gave their reservation back
    # The operator may do anything: read and remove any tenant's, and clear.
    assert op.get(A + b"k1") == b"a1" and op.delete_prefix(B) == 2 and not b.exists(B + b"k1")
    assert a.delete_prefix(A) == 1 and a.delete(A + b"k1") is False
    op.clear()
    assert not op.exists(UNSALTED)
    for c in (op, a, b):
        c.close()


def test_wrong_or_missing_tokens_are_refused(server: CacheServerProcess) -> None:
    for token in (None, "wrong", TOKEN_A + "x", TAG_A, "salt-of-b"):
        with pytest.raises(ServerReplyError) as info:
            _client(server, token).put(A + b"intruder", b"x")
        assert info.value.status == (Status.AUTH_REQUIRED if token is None else Status.AUTH_FAILED)
    assert not _client(server, OPERATOR).exists(A + b"intruder")


def test_refusal_on_the_wire_and_rescoping(server: CacheServerProcess) -> None:
    frames = (P.encode_frame(Op.AUTH, 1, payload=TOKEN_A.encode()) + P.encode_frame(Op.GET, 2, B + b"k")
              + P.encode_frame(Op.CLEAR, 3) + P.encode_frame(Op.AUTH, 4, payload=TOKEN_B.encode())
              + P.encode_frame(Op.PUT, 5, B + b"k", b"v") + P.encode_frame(Op.PING, 6))
    data, pos, replies = raw_exchange(server.port, frames), 0, []
    while pos < len(data):
        h = P.decode_header(data, 1 << 20, pos)
        replies.append((h.request_id, h.code, data[pos + P.HEADER_SIZE:pos + P.HEADER_SIZE + h.payload_len]))
        pos += P.HEADER_SIZE + h.payload_len
    assert [(rid, code) for rid, code, _ in replies] == [
        (1, Status.OK), (2, Status.FORBIDDEN), (3, Status.FORBIDDEN), (4, Status.OK), (5, Status.OK), (6, Status.OK)]
    assert b"covers only keys starting" in replies[1][2] and b"operator" in replies[2][2]
    assert TOKEN_A.encode() not in data and TOKEN_A not in server.log()


def test_the_tier_with_a_tenant_token(server: CacheServerProcess) -> None:
    """`kvtier://...?auth_token=<tenant token>`: the tenant's chunks are stored and found;
    others' keys are misses and unstored, never tier errors (no breaker trips)."""
    tier = create_backend(TierSpec.from_url(f"{server.url}?auth_token={TOKEN_A}"))
    assert isinstance(tier, CacheServerBackend)
    kv = torch.arange(2 * 2 * 4 * 2 * 8, dtype=torch.float16).reshape(2, 2, 4, 2, 8)
    own, other = A.decode() + "m0:float16:v1:c4:aa", UNSALTED.decode()
    try:
        assert tier.batched_put([(own, kv), (other, kv)]) == [True, False]
        assert tier.batched_contains([own, other]) == [True, False]
        assert leading_run(tier.batched_contains([other, own])) == 0
        got = tier.batched_get([own, other])
        assert got[1] is None and got[0] is not None and torch.equal(got[0], kv)
        assert tier.stats().errors == 0
    finally:
        tier.close()


def test_tenant_tokens_without_an_operator_token(cache_server_factory: type[CacheServerProcess],
                                                 tmp_path: Path) -> None:
    tokens = tmp_path / "tenants.yaml"
    tokens.write_text(f"{TOKEN_A}: '{TAG_A}'\n")
    server = cache_server_factory("--tenant-tokens", str(tokens))
    a = _client(server, TOKEN_A)
    assert a.put(A + b"k", b"v") and not a.put(UNSALTED, b"v")
    with pytest.raises(ServerReplyError) as info:
        _client(server, None).ping()
    assert info.value.status == Status.AUTH_REQUIRED


@pytest.mark.parametrize(("content", "error"), [
    ({TOKEN_A: "not-a-tag"}, "entry 0: a tenant tag is 16 lowercase hex digits"),
    ({TOKEN_A: {"cache_salt": "a/b"}}, "entry 0: cache_salt must be at most 128 characters"),
    ({TOKEN_A: {"salt": "x"}}, "entry 0: a mapping holds exactly cache_salt"),
    ({TOKEN_A: TAG_A, TOKEN_B: {"cache_salt": None}}, "entry 1: cache_salt must be a non-empty string"),
    ({TOKEN_A: 5}, "entry 0: a tenant tag is 16 lowercase hex digits"),
    ({}, "expected a non-empty mapping"),
    (f"{TOKEN_A}: [unclosed", "not valid JSON or YAML at line 1"),
])
def test_a_bad_tokens_file_names_no_token(tmp_path: Path, content: dict | str, error: str) -> None:
    tokens = tmp_path / "tenants.json"
    tokens.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=error) as info:
        load_tenant_tokens(str(tokens))
    assert TOKEN_A not in str(info.value)


def test_a_tenant_token_equal_to_the_operators_is_a_startup_error(
        cache_server_factory: type[CacheServerProcess], tmp_path: Path) -> None:
    tokens = tmp_path / "tenants.json"
    tokens.write_text(json.dumps({TOKEN_A: TAG_A, OPERATOR: TAG_A}))
    with pytest.raises(RuntimeError, match="a tenant token equals the operator's --auth-token") as info:
        cache_server_factory("--auth-token", OPERATOR, "--tenant-tokens", str(tokens))
    said = str(info.value).split(" ends:", 1)[1]  # what the server wrote (the fixture adds its command line)
    assert TOKEN_A not in said and OPERATOR not in said
