"""--tls-cert/--tls-key and the kvtiers:// tier, with a certificate made for the test by the
openssl command-line tool (a throwaway CA and a server certificate for 127.0.0.1)."""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch

from harness import process
from harness.cache_server import CacheServerProcess
from harness.polling import wait_until
from kvkeys.keyspace import Keyspace
from kvstore.backend import BackendError, leading_run
from kvstore.backends.cache_server_tier import CacheServerBackend, client_tls_context
from kvstore.backends.server_client import CacheServerClient, ServerUnavailable
from kvstore.cache_server import protocol as P
from kvstore.cache_server.protocol import Op
from kvstore.cache_server.server import HEAP_SLACK_BYTES, PER_TLS_CONNECTION_BYTES
from kvstore.registry import create_backend
from kvstore.store_config import TierSpec
from tests.fixtures.cache_server import raw_exchange

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
TOKEN = "tls-token"


def _openssl(*args: str, cwd: Path) -> None:
    process.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with ca.pem (a throwaway CA), server.pem/server.key (signed by it, for
    IP 127.0.0.1) and other-ca.pem (a CA that signed nothing here)."""
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=kvtier test CA", cwd=d
    )
    _openssl(
        "req", "-x509", *ec, "-keyout", "other.key", "-out", "other-ca.pem", "-days", "2", "-subj", "/CN=other", cwd=d
    )
    _openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=d)
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf", cwd=d)
    return d


@pytest.fixture
def tls_server(cache_server_factory: type[CacheServerProcess], pki: Path) -> CacheServerProcess:
    return cache_server_factory("--max-bytes", "64MiB", "--auth-token", TOKEN,
                                "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"))


def _tls_client(server: CacheServerProcess, ca: Path, **kw: object) -> CacheServerClient:
    return CacheServerClient("127.0.0.1", server.port, auth_token=TOKEN,
                             tls=client_tls_context(ca, "test"), **kw)  # type: ignore[arg-type]


def test_kvtiers_tier_round_trips_chunks(tls_server: CacheServerProcess, pki: Path) -> None:
    url = f"kvtiers://127.0.0.1:{tls_server.port}?ca_file={pki / 'ca.pem'}&auth_token={TOKEN}"
    tier = create_backend(TierSpec.from_url(url))
    assert isinstance(tier, CacheServerBackend) and repr(tier).startswith("CacheServerBackend(kvtiers://")
    keys = [sp.key for sp in Keyspace("smol-test", "float16", 256, num_layers=1).spans(list(range(512)))]
    chunks = [torch.randn(30, 2, 256, 3, 64, generator=torch.Generator().manual_seed(i)).half() for i in range(2)]
    tier.batched_put(list(zip(keys, chunks)))
    got = tier.batched_get(keys)
    assert all(torch.equal(g, c) for g, c in zip(got, chunks)) and leading_run(tier.batched_contains(keys)) == 2
    tier.close()


def test_large_values_and_pipelines_over_tls(tls_server: CacheServerProcess, pki: Path) -> None:
    c = _tls_client(tls_server, pki / "ca.pem")
    values = [os.urandom(9 << 20), os.urandom(100), os.urandom(3 << 20)]
    keys = [b"a", b"b", b"c"]
    assert all(c.put_many(list(zip(keys, values))))
    assert c.get_many(keys + [b"absent"]) == values + [None]
    assert c.stats()["pinned_bytes"] == 0
    c.close()


def test_stalled_tls_readers_stay_within_the_bound(tls_server: CacheServerProcess, pki: Path) -> None:
    """20 TLS clients GET a 32 MiB value and never read: the process stays under the
    documented bound with the TLS per-connection overhead (docs/protocol.md)."""
    good = _tls_client(tls_server, pki / "ca.pem")
    assert good.ping()
    base = tls_server.memory_bytes("VmRSS")
    assert good.put(b"v", os.urandom(32 << 20))
    ctx = client_tls_context(pki / "ca.pem", "test")
    readers = []
    try:
        for _ in range(20):
            raw = socket.create_connection(("127.0.0.1", tls_server.port), timeout=10)
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            s = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
            readers.append(s)
            s.sendall(P.encode_frame(Op.AUTH, 1, payload=TOKEN.encode()) + P.encode_frame(Op.GET, 2, b"v"))
        wait_until(lambda: good.stats()["connections"] >= 21, 10.0, 0.05)
        time.sleep(0.5)  # every reply has started and stalled
        peak = tls_server.memory_bytes("VmHWM")
        bound = base + (64 << 20) + HEAP_SLACK_BYTES + 21 * PER_TLS_CONNECTION_BYTES + (4 << 20)
        print(f"TLS stalled readers: peak - base {(peak - base) / (1 << 20):.1f} MiB")
        assert peak <= bound, (peak - base) / (1 << 20)
    finally:
        for s in readers:
            s.close()
    good.close()


def test_clients_that_do_not_verify_or_speak_tls_are_refused(tls_server: CacheServerProcess, pki: Path) -> None:
    # A certificate from another CA, or none (the system store does not know ours): no session.
    for ca in (pki / "other-ca.pem", None):
        c = CacheServerClient("127.0.0.1", tls_server.port, auth_token=TOKEN, tls=client_tls_context(ca, "test"))
        with pytest.raises(ServerUnavailable, match="TLS handshake .* failed: .*CERTIFICATE_VERIFY_FAILED"):
            c.ping()
    # A plaintext client gets no frame back: its bytes are not a TLS handshake.
    data = raw_exchange(
        tls_server.port, P.encode_frame(Op.AUTH, 1, payload=TOKEN.encode()) + P.encode_frame(Op.PING, 2)
    )
    assert P.MAGIC not in data
    assert _tls_client(tls_server, pki / "ca.pem").ping()  # the server is unharmed


def test_tls_options_are_checked(cache_server_factory: type[CacheServerProcess], pki: Path) -> None:
    with pytest.raises(RuntimeError, match="--tls-cert and --tls-key go together"):
        cache_server_factory("--tls-cert", str(pki / "server.pem"))
    with pytest.raises(RuntimeError, match="cannot load TLS certificate .*missing.pem"):
        cache_server_factory("--tls-cert", str(pki / "missing.pem"), "--tls-key", str(pki / "server.key"))
    with pytest.raises(RuntimeError, match="cannot load TLS certificate"):
        cache_server_factory("--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "other.key"))
    with pytest.raises(ValueError, match="ca_file is for TLS; use kvtiers://"):
        create_backend(TierSpec.from_url(f"kvtier://127.0.0.1:1?ca_file={pki / 'ca.pem'}"))
    with pytest.raises(ValueError, match="cannot load ca_file"):
        create_backend(TierSpec.from_url(f"kvtiers://127.0.0.1:1?ca_file={pki / 'missing.pem'}"))


def test_a_tier_over_tls_reports_an_unreachable_server(pki: Path) -> None:
    tier = create_backend(TierSpec.from_url(f"kvtiers://127.0.0.1:1?ca_file={pki / 'ca.pem'}"))
    with pytest.raises(BackendError, match="kvtiers://127.0.0.1:1"):
        tier.contains("x")
