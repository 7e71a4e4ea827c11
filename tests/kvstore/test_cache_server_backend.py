"""The `kvtier://host:port` tier against a real cache server process."""

from __future__ import annotations

import threading

import pytest
import torch

from harness.cache_server import CacheServerProcess
from harness.polling import wait_until
from kvkeys.keyspace import Keyspace
from kvstore import serde
from kvstore.backend import BackendError, leading_run
from kvstore.backends.cache_server_tier import CacheServerBackend
from kvstore.backends.memory import CPUBackend
from kvstore.registry import create_backend
from kvstore.storage_manager import StorageManager
from kvstore.store_config import KVStoreConfig, TierSpec
from tests.fixtures.tiers import longest_calls_while_frozen

SHAPE = (30, 2, 256, 3, 64)  # one 256-token chunk of the default model


def _keys(n: int, seed: int = 0) -> list[str]:
    tokens = list(range(seed, seed + 256 * n))
    return [sp.key for sp in Keyspace("smol-test", "float16", 256, num_layers=1).spans(tokens)]


def _chunk(i: int, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(shape, generator=g).to(torch.float16)


@pytest.fixture
def tier(cache_server: CacheServerProcess) -> CacheServerBackend:
    backend = create_backend(TierSpec.from_url(cache_server.url))
    assert isinstance(backend, CacheServerBackend)
    yield backend
    backend.close()


def test_chunks_round_trip_through_the_server(tier: CacheServerBackend) -> None:
    keys = _keys(4)
    chunks = [_chunk(i) for i in range(4)]
    tier.put(keys[0], chunks[0])
    tier.batched_put(list(zip(keys[1:3], chunks[1:3])))
    assert torch.equal(tier.get(keys[0]), chunks[0])
    got = tier.batched_get(keys)
    assert all(torch.equal(g, c) for g, c in zip(got[:3], chunks[:3])) and got[3] is None
    assert tier.contains(keys[2]) and not tier.contains(keys[3])
    assert leading_run(tier.batched_contains(keys)) == 3 and leading_run(tier.batched_contains(keys[1:])) == 2
    assert leading_run(tier.batched_contains([])) == 0
    assert tier.delete(keys[0]) and not tier.delete(keys[0]) and leading_run(tier.batched_contains(keys)) == 0
    stats = tier.stats()
    assert stats.entries == 2 and stats.hits == 4 and stats.misses == 1 and stats.puts == 3
    assert stats.byte_budget == 256 << 20 and stats.bytes_used > 2 * chunks[0].numel() * 2
    tier.clear()
    assert tier.stats().entries == 0


def test_lz4_codec_and_url_options(cache_server_factory: type[CacheServerProcess]) -> None:
    server = cache_server_factory("--auth-token", "tok")
    spec = TierSpec.from_url(f"{server.url}?codec=lz4&auth_token=tok&timeout_s=5&pool_size=2")
    tier = create_backend(spec)
    kv = _chunk(1, (4, 2, 100, 3, 64))
    tier.put("k", kv)
    assert torch.equal(tier.get("k"), kv)
    tier.close()
    with pytest.raises(ValueError, match="unknown cache server tier option"):
        create_backend(TierSpec.from_url(f"{server.url}?colour=red"))
    with pytest.raises(ValueError, match="has no host"):
        TierSpec.from_url("kvtier://:65432")
    with pytest.raises(ValueError, match="set it on the server"):
        create_backend(TierSpec.from_url(f"{server.url}?budget=1GiB"))
    with pytest.raises(ValueError, match=r"no client-side eviction policy; set it on the server "
                                         r"\(kvtier cache-server --eviction\)"):
        create_backend(TierSpec.from_url(f"{server.url}?eviction=fifo"))
    with pytest.raises(ValueError, match="lookup_timeout_s must be positive"):
        create_backend(TierSpec.from_url(f"{server.url}?lookup_timeout_s=0"))


def test_a_frozen_server_stalls_lookups_briefly_and_is_used_again_after(
    cache_server_factory: type[CacheServerProcess],
) -> None:
    """Existence checks run within `lookup_timeout_s` (0.5 s by default) on their own
    connections: a SIGSTOPped server costs a lookup that long, not the 10 s of `timeout_s`."""
    server = cache_server_factory()
    tier = create_backend(TierSpec.from_url(server.url))
    mgr = StorageManager([CPUBackend(), tier], names=["cpu", "server"])
    keys = _keys(3)
    tier.batched_put([(k, _chunk(i, (2, 2, 16, 3, 64))) for i, k in enumerate(keys)])
    calls = {"tier_prefix_hits": lambda: mgr.tier_prefix_hits(keys),
             "batched_contains": lambda: mgr.batched_contains(keys),
             "contains": lambda: mgr.batched_contains([keys[0]])}
    assert server.proc is not None
    # the first calls time out; later ones are skipped, or probe once the backoff elapsed
    took = longest_calls_while_frozen(server.proc.pid, calls, rounds=3, pause_s=0.3)
    assert not mgr.stats()["server"].read_healthy  # no call since it was resumed
    assert max(took.values()) < 3.0, took  # each used to wait out timeout_s (10 s)
    wait_until(lambda: mgr.tier_prefix_hits(keys)["server"] == 3, 10.0, 0.05)
    assert mgr.tier_prefix_hits(keys)["server"] == 3
    assert torch.equal(mgr.fetch(keys)[2][0], _chunk(2, (2, 2, 16, 3, 64)))
    mgr.close()


def test_wrong_token_is_a_backend_error(cache_server_factory: type[CacheServerProcess]) -> None:
    server = cache_server_factory("--auth-token", "right")
    tier = create_backend(TierSpec.from_url(f"{server.url}?auth_token=wrong"))
    with pytest.raises(BackendError, match="AUTH_FAILED"):
        tier.contains("k")
    assert tier.stats().errors >= 1


def test_corrupt_or_foreign_values_are_misses(tier: CacheServerBackend) -> None:
    a, b = _keys(2)
    kv = _chunk(3, (2, 2, 16, 3, 64))
    tier.put(a, kv)
    raw = tier.client.get(a.encode())
    tier.client.put(b.encode(), raw)  # foreign: a value copied under another key
    assert tier.get(b) is None
    damaged = bytearray(raw)
    damaged[len(damaged) // 2] ^= 0x40
    tier.client.put(a.encode(), damaged)
    assert tier.get(a) is None
    tier.client.put(a.encode(), raw[: len(raw) // 2])  # truncated
    assert tier.get(a) is None
    assert tier.stats().corrupt == 3


def test_values_received_in_many_pieces_are_checked_as_they_arrive(tier: CacheServerBackend) -> None:
    keys = _keys(4)
    big = [_chunk(i) for i in range(3)]  # 5.9 MB each, pipelined one after another
    assert big[0].nbytes > 2 * serde.CHECK_PIECE
    tier.batched_put(list(zip(keys, big)))
    raw = bytearray(tier.client.get(keys[1].encode()))
    raw[-1] ^= 0x80  # its last byte
    tier.client.put(keys[1].encode(), raw)
    tier.client.put(keys[3].encode(), b"KVT")  # shorter than any header
    got = tier.batched_get(keys)
    assert torch.equal(got[0], big[0]) and torch.equal(got[2], big[2])
    assert got[1] is None and got[3] is None
    assert tier.stats().corrupt == 2


def test_too_large_for_the_server_is_rejected_not_an_error(cache_server_factory: type[CacheServerProcess]) -> None:
    server = cache_server_factory("--max-bytes", "1MiB")
    tier = create_backend(TierSpec.from_url(server.url))
    tier.put("big", _chunk(0))  # ~5.9 MB > 1 MiB
    small = _chunk(1, (1, 2, 8, 3, 64))
    tier.put("small", small)
    assert tier.get("big") is None and torch.equal(tier.get("small"), small)
    stats = tier.stats()
    assert stats.rejected == 1 and stats.errors == 0
    tier.close()


def test_recovers_after_a_server_restart(cache_server_factory: type[CacheServerProcess]) -> None:
    server = cache_server_factory()
    tier = create_backend(TierSpec.from_url(server.url + "?connect_timeout_s=0.5"))
    key = _keys(1)[0]
    kv = _chunk(5, (2, 2, 32, 3, 64))
    tier.put(key, kv)
    assert server.stop() == 0
    with pytest.raises(BackendError, match="cannot connect"):
        tier.get(key)  # down: a clear error, which the storage manager turns into a miss
    with pytest.raises(BackendError):
        tier.put(key, kv)
    server.start()  # same port, empty memory
    assert tier.get(key) is None  # the next call reconnects
    tier.put(key, kv)
    assert torch.equal(tier.get(key), kv)
    assert tier.stats().errors == 2
    tier.close()


def test_threads_share_one_tier(tier: CacheServerBackend) -> None:
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i, key in enumerate(_keys(6, seed=10_000 * n)):
                kv = _chunk(100 * n + i, (2, 2, 64, 3, 64))
                tier.put(key, kv)
                assert torch.equal(tier.get(key), kv)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert tier.stats().entries == 36


def test_two_storage_managers_share_through_the_server(cache_server: CacheServerProcess) -> None:
    """A writer's chunks reach a reader that has only its own empty cpu tier and the server."""
    config = KVStoreConfig(tiers=[TierSpec("cpu", budget=64 << 20), TierSpec(cache_server.url)])
    keys = _keys(3, seed=7)
    chunks = [_chunk(i, (4, 2, 256, 3, 64)) for i in range(3)]
    with StorageManager.from_config(config) as writer:
        writer.batched_put(list(zip(keys, chunks)))
        assert writer.flush(timeout=30)
        assert writer.stats()["1:" + cache_server.url].errors == 0, writer.stats()
    with StorageManager.from_config(config) as reader:
        assert reader.batched_contains(keys) == [True] * 3, (reader.stats(), writer.stats(), writer.writer_stats())
        got = [kv for kv, _ in reader.fetch(keys)]
        assert all(torch.equal(g, c) for g, c in zip(got, chunks))
        assert reader.stats()["1:" + cache_server.url].hits == 3
