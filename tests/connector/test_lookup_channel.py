"""The scheduler process's existence questions, answered by the worker process's held keys
(`LocalHeldKeys`) over the lookup channel (connector/vllm/lookup_channel.py)."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from connector.presence import Found, LocalHeldKeys, Presence
from connector.vllm.lookup_channel import LookupClient, LookupServer, lookup_socket_path, scheduler_socket_path
from connector.vllm.lookup_ops import MAX_BODY_BYTES, QUESTIONS, FindQuestion, HeldQuestion
from kvkeys.keyspace import Keyspace
from kvstore.storage_manager import StorageManager
from kvstore.store_config import KVStoreConfig, TierSpec

KS = Keyspace("m", torch.float32, 4, num_layers=2)


@pytest.fixture
def storage() -> Iterator[StorageManager]:
    with StorageManager.from_config(KVStoreConfig(tiers=[TierSpec(url="cpu")])) as s:
        yield s


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "lookup.sock"


def test_remote_answers_equal_local_ones_pending_stores_included(storage: StorageManager, path: Path) -> None:
    spans = KS.spans(list(range(16)))
    storage.batched_put([(spans[0].key, torch.zeros(2, 2, 4, 1, 8))])
    pending = {spans[2].key}
    local = LocalHeldKeys(storage, pending.__contains__)
    server = LookupServer(local, path)
    remote = LookupClient(path)
    try:
        want = [True, False, True, False]
        assert Presence([remote]).chunks_held(KS, spans) == Presence([local]).chunks_held(KS, spans) == want
        assert remote.held([]) == []
        assert remote.failures == 0
    finally:
        remote.close()
        server.close()
    assert not path.exists()


def test_a_malformed_question_ends_only_its_connection(storage: StorageManager, path: Path) -> None:
    server = LookupServer(LocalHeldKeys(storage), path)
    remote = LookupClient(path)
    try:
        bad = socket.socket(socket.AF_UNIX)
        bad.connect(str(path))
        bad.sendall(struct.pack("<BI", HeldQuestion.op, MAX_BODY_BYTES + 1))  # a body past the bound
        assert bad.recv(1) == b""  # the server closed it
        bad.close()
        unknown = socket.socket(socket.AF_UNIX)
        unknown.connect(str(path))
        unknown.sendall(struct.pack("<BI", max(QUESTIONS) + 1, 0))  # an op no server knows
        assert unknown.recv(1) == b""
        unknown.close()
        extra = socket.socket(socket.AF_UNIX)
        extra.connect(str(path))
        body = HeldQuestion(["k"]).encode() + b"x"  # a byte past the body's last field
        extra.sendall(struct.pack("<BI", HeldQuestion.op, len(body)) + body)
        assert extra.recv(1) == b""
        extra.close()
        storage.batched_put([("k", torch.zeros(1, 2, 1, 1, 4))])
        assert remote.held(["k", "x"]) == [True, False]
    finally:
        remote.close()
        server.close()


def test_per_tier_prefixes_equal_the_local_storage_answer(path: Path) -> None:
    """The question `vllm serve`'s /kv/lookup asks: leading keys per tier, pending stores not counted."""
    config = KVStoreConfig(tiers=[TierSpec(url="cpu"), TierSpec(url="cpu")])
    with StorageManager.from_config(config) as two:
        fast, slow = two.names
        keys = KS.stored_keys(KS.spans(list(range(16))))
        two.tiers[0].put(keys[0], torch.zeros(2, 2, 4, 1, 8))
        for k in keys[:3]:
            two.tiers[1].put(k, torch.zeros(2, 2, 4, 1, 8))
        local = LocalHeldKeys(two, {keys[3]}.__contains__)
        server = LookupServer(local, path)
        remote = LookupClient(path, timeout=2.0, connect_timeout=0.2)
        try:
            assert remote.tier_prefix_hits(keys) == two.tier_prefix_hits(keys) == {fast: 1, slow: 3}
            assert remote.tier_prefix_hits([]) == {fast: 0, slow: 0}
            assert remote.held(keys) == [True, True, True, True]  # the same connection, the other op
            assert remote.failures == 0
        finally:
            remote.close()
            server.close()
    assert remote.tier_prefix_hits(keys) == {} and remote.failures == 1  # no server: nothing known


def test_no_server_is_a_miss_and_a_restarted_server_is_found_again(storage: StorageManager, path: Path) -> None:
    remote = LookupClient(path, timeout=2.0, connect_timeout=0.2)
    storage.batched_put([("k", torch.zeros(1, 2, 1, 1, 4))])
    assert remote.held(["k"]) == [False] and remote.failures == 1
    server = LookupServer(LocalHeldKeys(storage), path)
    try:
        assert remote.held(["k"]) == [True]
        server.close()
        assert remote.held(["k"]) == [False] and remote.failures == 2
    finally:
        remote.close()
        server.close()


def test_socket_is_owner_only_and_ids_are_checked(storage: StorageManager, path: Path) -> None:
    server = LookupServer(LocalHeldKeys(storage), path)
    try:
        assert path.stat().st_mode & 0o077 == 0
    finally:
        server.close()
    assert lookup_socket_path("0b2c-uuid_1.x").name == "kvtier-lookup-0b2c-uuid_1.x-rank0.sock"
    assert lookup_socket_path("0b2c-uuid_1.x", 1).name == "kvtier-lookup-0b2c-uuid_1.x-rank1.sock"
    with pytest.raises(ValueError, match="instance id"):
        lookup_socket_path("../etc")
    assert scheduler_socket_path("0b2c").name == "kvtier-lookup-0b2c-scheduler.sock"
    with pytest.raises(ValueError, match="instance id"):
        scheduler_socket_path("a/b")


def test_the_scheduler_side_answers_its_engines_prefix_cache_and_refuses_tier_ops(path: Path) -> None:
    """vLLM's own prefix cache lives in the scheduler's process: its server (no tiers) answers
    `EnginePrefixQuestion` with the engine's count for the prompt and salt asked; a tier question
    asked of it ends that connection (a miss), and an answer out of range is no answer."""
    asked: list[tuple[list[int], str | None]] = []

    def engine_prefix(ids: list[int], salt: str | None) -> int:
        asked.append((ids, salt))
        return 0 if salt else len(ids) // 16 * 16

    server = LookupServer(None, path, engine_prefix=engine_prefix)
    remote = LookupClient(path, timeout=5.0, connect_timeout=0.2)
    try:
        assert remote.engine_prefix(list(range(40))) == 32
        assert remote.engine_prefix(list(range(40)), "tenant-a") == 0
        assert asked == [(list(range(40)), None), (list(range(40)), "tenant-a")]
        assert remote.held(["k"]) == [False] and remote.failures == 1  # not a worker: no tiers to ask
        assert remote.engine_prefix(list(range(20))) == 16  # the next question reconnects
        assert remote.engine_prefix(list(range(10))) == 0
    finally:
        remote.close()
        server.close()
    lying = LookupServer(None, path, engine_prefix=lambda ids, salt: len(ids) + 1)
    worker = LookupServer(None, path.with_name("w.sock"))  # a server without an engine answers {}
    asks = [LookupClient(p, timeout=5.0) for p in (path, worker.path)]
    try:
        assert [a.engine_prefix([1, 2, 3]) for a in asks] == [None, None]
    finally:
        for a in asks:
            a.close()
        lying.close()
        worker.close()


@pytest.mark.parametrize("clear_shared", [False, True])
def test_a_reset_clears_the_local_tiers_and_the_shared_ones_only_when_asked(path: Path, tmp_path: Path,
                                                                            clear_shared: bool) -> None:
    """vLLM's reset_cache: the cpu tier is emptied; the disk tier (shared with other processes)
    too with `reset_clears_shared_tiers` (what the worker's `clear_local` does)."""
    config = KVStoreConfig(tiers=[TierSpec(url="cpu"), TierSpec(url=f"disk://{tmp_path / 'kv'}")])
    with StorageManager.from_config(config) as two:
        keys = KS.stored_keys(KS.spans(list(range(8))))
        two.batched_put([(k, torch.zeros(2, 2, 4, 1, 8)) for k in keys])
        assert two.flush(10)
        before = two.tier_prefix_hits(keys)
        assert list(before.values()) == [len(keys), len(keys)]
        server = LookupServer(LocalHeldKeys(two), path, clear_local=lambda: two.clear(local_only=not clear_shared))
        remote = LookupClient(path, timeout=5.0, connect_timeout=0.2)
        try:
            assert remote.clear_local()
            cpu, disk = two.tier_prefix_hits(keys).values()
            assert (cpu, disk) == (0, 0 if clear_shared else len(keys))
        finally:
            remote.close()
            server.close()


def test_a_find_is_one_round_trip_and_equals_the_local_find(path: Path) -> None:
    """The planner's lookup: the run held, each chunk's tier (a pending store's: the fastest),
    and the partial chunk stored where the run stops, answered as the worker's own presence
    answers it, in one round trip."""
    config = KVStoreConfig(tiers=[TierSpec(url="cpu"), TierSpec(url="cpu")])
    with StorageManager.from_config(config) as two:
        short = list(range(10))  # chunks [0,4) [4,8), partial [8,10)
        stored = KS.spans(short)
        two.tiers[0].put(stored[0].key, torch.zeros(2, 2, 4, 1, 8))
        two.tiers[1].put(stored[2].key, torch.zeros(2, 2, 2, 1, 8))
        local = LocalHeldKeys(two, {stored[1].key}.__contains__)  # chunk 1 still queued
        grown = short + [50, 51, 52, 53, 54]
        spans = KS.spans(grown)
        server = LookupServer(local, path, KS)
        remote = LookupClient(path, timeout=5.0, connect_timeout=0.2)
        try:
            want = local.find(KS, grown, 0, spans, KS.root, 0)
            assert want == Found([0, 0], tuple(two.names), stored[2], 1)
            assert remote.find(KS, grown, 0, spans, KS.root, 0) == want
            assert remote.questions == 1 and remote.failures == 0
            late = remote.find(KS, grown[4:], 4, spans[1:], spans[0].chain, 9)  # a partial ending at 10 > 9
            assert late == local.find(KS, grown[4:], 4, spans[1:], spans[0].chain, 9) == Found([0], tuple(two.names),
                                                                                                 stored[2], 1)
            assert remote.find(KS, grown, 0, spans, KS.root, 10).partial is None  # it would load nothing
            salted = KS.for_salt("tenant")
            assert remote.find(salted, grown, 0, salted.spans(grown), salted.root, 0) == Found([], tuple(two.names))
        finally:
            remote.close()
            server.close()


def test_a_find_from_another_keyspace_is_refused_and_a_bad_one_dropped(storage: StorageManager, path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    spans = KS.spans(list(range(8)))
    storage.batched_put([(sp.key, torch.zeros(2, 2, 4, 1, 8)) for sp in spans])
    server = LookupServer(LocalHeldKeys(storage), path, KS)
    remote = LookupClient(path, timeout=5.0, connect_timeout=0.2)
    try:
        assert remote.find(KS, list(range(8)), 0, spans, KS.root, 0).tiers == [0, 0]
        other = Keyspace("m", torch.float32, 4, num_layers=3)  # keys alike, but not the same chunks
        assert remote.find(other, list(range(8)), 0, spans, KS.root, 0) == Found()
        assert "refused" in caplog.text and remote.failures == 0  # answered: a miss, not a broken channel
        bad = socket.socket(socket.AF_UNIX)
        bad.connect(str(path))
        bad.sendall(struct.pack("<BI", FindQuestion.op, 3) + b"abc")  # a truncated body
        assert bad.recv(1) == b""
        bad.close()
        assert remote.find(KS, list(range(8)), 0, spans, KS.root, 0).tiers == [0, 0]
    finally:
        remote.close()
        server.close()
