"""Explaining a miss (connector/explain.py, connector/key_families.py, issue #50): over real
shared tiers (disk, Redis, the cache server) a writer with its own storage manager (as another
process) stores a prompt in one key family, and explain, asked in another family, names what
differs: chunk size, dtype, model, engine tag or tenant; a cpu tier that evicted the chunk says
so; a prompt never stored is named as such. No model runs: keys come from the keyspace."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from connector.engine_connector import build_connector
from connector.explain import explain
from connector.key_families import INDEX_KEY, FamilyIndex, _publisher, decode_index
from connector.presence import LocalHeldKeys, Presence
from connector.vllm.lookup_channel import LookupClient, LookupServer
from kvkeys.keyspace import Keyspace
from kvstore.storage_manager import StorageManager
from kvstore.store_config import KVStoreConfig, TierSpec
from tests.fixtures.connector import tier_url

ASKED = Keyspace("m1", "float16", 32, 2)
STORED = {  # cause -> the family the prompt was stored in (one field differs from ASKED)
    "chunk_size": Keyspace("m1", "float16", 16, 2),
    "kv_dtype": Keyspace("m1", "bfloat16", 32, 2),
    "model": Keyspace("m2", "float16", 32, 2),
    "engine_tag": Keyspace("m1+vllm-cpu", "float16", 32, 2),
    "tenant": Keyspace("m1", "float16", 32, 2, cache_salt="alice"),
}


def prompt(i: int, n: int = 80) -> list[int]:
    return [1000 * (i + 1) + t for t in range(n)]


def manager(url: str) -> StorageManager:
    return StorageManager.from_config(KVStoreConfig(tiers=[TierSpec.from_url(url, "tier")]))


def store(storage: StorageManager, ks: Keyspace, tokens: list[int]) -> None:
    """Stores `tokens`' chunks in `ks`'s family as the connector's saver does (chunks, then its
    family in the index)."""
    spans = ks.spans(tokens)
    storage.batched_put([(k, torch.zeros(1, 2, sp.num_tokens, 1, 4)) for sp, k in zip(spans, ks.stored_keys(spans))])
    index = FamilyIndex.of(storage)
    family = index.note(ks)
    if family is not None:
        index.publish(family)


def causes(storage: StorageManager, ks: Keyspace, tokens: list[int], **kw: bool) -> list[dict]:
    return list(explain(storage, ks, Presence([LocalHeldKeys(storage)]), tokens, **kw)["tiers"].values())


@pytest.mark.parametrize("tier", ["disk", "redis", "kvtier"])
def test_each_cause_across_processes(tier: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    url = tier_url(tier, tmp_path, request)
    writer = manager(url)
    try:
        for i, ks in enumerate(STORED.values()):
            store(writer, ks, prompt(i))
        store(writer, ASKED, prompt(9))
    finally:
        writer.close()
    reader = manager(url)  # another storage manager, its own (empty) family index: as another process
    try:
        assert len(decode_index(reader.tier_get(reader.names[0], INDEX_KEY))) == 6
        for i, (cause, ks) in enumerate(STORED.items()):
            [answer] = causes(reader, ASKED, prompt(i))
            assert answer["cause"] == cause, answer
            assert answer["held_tokens"] == 0 and answer["neighbour_tokens"] == 79
            expected = {"chunk_size": (16, 32), "kv_dtype": ("bfloat16", "float16"), "model": ("m2", "m1"),
                        "engine_tag": ("vllm-cpu", ""), "tenant": (ks.tenant, None)}[cause]
            assert (answer["stored"][cause], answer["asked"][cause]) == expected
        [hit] = causes(reader, ASKED, prompt(9))
        assert hit["cause"] == "hit" and hit["held_tokens"] == 79
        [never] = causes(reader, ASKED, prompt(42))
        assert never["cause"] == "not_stored"  # this tier cannot tell never stored from evicted
        [hidden] = causes(reader, ASKED, prompt(4), other_tenants=False)  # a tenant learns nothing of alice's
        assert hidden["cause"] == "not_stored"
    finally:
        reader.close()


def test_evicted_and_never_stored_in_a_cpu_tier() -> None:
    chunk = 32 * 2 * 1 * 4 * 4  # one (1, 2, 32, 1, 4) float32 chunk
    storage = manager(f"cpu://?budget={2 * chunk}")
    try:
        store(storage, ASKED, prompt(0, 64))  # two chunks: the budget
        [held] = causes(storage, ASKED, prompt(0, 64))
        assert held["cause"] == "hit"
        store(storage, ASKED, prompt(1, 64))  # evicts the first prompt's chunks
        [gone] = causes(storage, ASKED, prompt(0, 64))
        assert gone["cause"] == "evicted" and gone["held_tokens"] == 0, gone
        [never] = causes(storage, ASKED, prompt(2, 64))
        assert never["cause"] == "never_stored", never
    finally:
        storage.close()


def test_explain_over_the_lookup_channel(tmp_path: Path) -> None:
    """`vllm serve`'s /kv/lookup asks the worker process over the lookup channel (`ExplainQuestion`),
    a long prompt's question cut into several keys."""
    storage = manager(f"disk://{tmp_path / 'kv'}")
    path = tmp_path / "lookup.sock"
    tokens = prompt(0, 3000)  # its JSON is longer than one key of the channel
    store(storage, STORED["kv_dtype"], tokens)
    held = LocalHeldKeys(storage)
    server = LookupServer(held, path, explainer=lambda ids, salt, others: explain(
        storage, ASKED.for_salt(salt), Presence([held]), ids, others))
    remote = LookupClient(path)
    try:
        answer = remote.explain(tokens)
        assert answer is not None and [t["cause"] for t in answer["tiers"].values()] == ["kv_dtype"]
        assert answer["num_tokens"] == 3000 and remote.failures == 0
        server.explainer = None
        assert remote.explain(tokens) is None  # a worker without explain
    finally:
        remote.close()
        server.close()
        storage.close()


def test_forgetting_a_tenant_drops_its_families_from_the_index(tmp_path: Path) -> None:
    storage = manager(f"disk://{tmp_path / 'kv'}")
    try:
        alice = STORED["tenant"]
        store(storage, alice, prompt(0))
        store(storage, ASKED, prompt(1))
        assert alice.tenant is not None
        FamilyIndex.of(storage).forget_tenant(alice.tenant)
        assert [f.tenant for f in decode_index(storage.tier_get(storage.names[0], INDEX_KEY))] == [None]
    finally:
        storage.close()


def test_shutdown_waits_for_the_index_thread(tmp_path: Path) -> None:
    """A connector's shutdown lets a publish in flight end (within its flush bound): a daemon
    thread still inside torch at interpreter exit would abort the process."""
    conn = build_connector([f"disk://{tmp_path}"], chunk_size=16)
    started, release = threading.Event(), threading.Event()
    _publisher().submit(lambda: (started.set(), release.wait(10)))
    assert started.wait(10)
    threading.Timer(0.3, release.set).start()
    conn.shutdown()
    assert release.is_set() and _publisher().pending() == 0
