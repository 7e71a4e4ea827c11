"""vLLM's scheduler asks each tensor-parallel rank's worker over its lookup channel: an
admitted request costs one round trip per rank, and that one answer also gives the load's hit
sources (which tier holds each chunk), the partial chunk where the run stops included."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from connector.connector_config import make_config
from connector.connector_metrics import ConnectorMetrics
from connector.planner import KVTierPlanner
from connector.presence import LocalHeldKeys, Presence
from connector.vllm.lookup_channel import LookupClient, LookupServer
from engine.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from kvstore.storage_manager import StorageManager
from kvstore.store_config import KVStoreConfig, TierSpec

CHUNK = 16
HEADS = [(0, 1), (1, 3)]  # the default model's 3 KV heads over two ranks


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[list[StorageManager]]:
    config = KVStoreConfig(tiers=[TierSpec(url="cpu"), TierSpec(url="cpu")])  # a fast and a slow tier per rank
    with StorageManager.from_config(config) as r0, StorageManager.from_config(config) as r1:
        yield [r0, r1]


def test_an_admitted_request_costs_one_round_trip_per_rank(default_model_path: Path, tmp_path: Path,
                                                          ranks: list[StorageManager]) -> None:
    mc = ModelConfig.from_pretrained(default_model_path)
    config = make_config(["cpu"], chunk_size=CHUNK)
    ks = config.keyspace(mc, torch.float32).for_heads(0, mc.num_kv_heads)
    servers, remotes = [], []
    for r, (storage, heads) in enumerate(zip(ranks, HEADS)):
        path = tmp_path / f"rank{r}.sock"
        servers.append(LookupServer(LocalHeldKeys(storage), path, ks.for_heads(*heads)))
        remotes.append(LookupClient(path, timeout=5.0, connect_timeout=0.5))
    planner = KVTierPlanner(config, Presence(remotes, HEADS), ConnectorMetrics())
    planner.register_model(mc, torch.float32, 16, ks)
    short = list(range(100, 156))  # chunks [0,16) [16,32) [32,48) and the partial [48,56) a last round stored
    stored = ks.spans(short)
    for storage, heads in zip(ranks, HEADS):
        rank_ks = ks.for_heads(*heads)
        for i, sp in enumerate(stored):
            value = torch.zeros(mc.num_layers, 2, sp.num_tokens, 1, mc.head_size)
            for key in rank_ks.stored_keys([sp]):
                storage.tiers[0 if i < 2 else 1].put(key, value)  # the third chunk and the partial one: slow tier
    grown = short + list(range(700, 744))  # the next round: [48,64) grew past what was stored
    seq = Sequence("r", grown, SamplingParams(max_tokens=1))
    try:
        assert planner.get_num_new_matched_tokens(seq, 0) == (56, True)  # three chunks and the partial one
        planner.update_state_after_alloc(seq, list(range(7)), 56)
        fast, slow = ranks[0].names
        assert planner.load_sources("r") == {fast: 32, slow: 24}
        assert [r.questions for r in remotes] == [1, 1]  # lookup, plan and hit sources: one each
        assert planner.load_sources("r") == {}  # given once
        assert [r.failures for r in remotes] == [0, 0]
        ranks[1].tiers[1].clear()  # rank 1 lost its slow tier: only what both ranks hold counts
        other = Sequence("o", grown, SamplingParams(max_tokens=1))
        assert planner.get_num_new_matched_tokens(other, 0) == (32, True)
        assert [r.questions for r in remotes] == [2, 2]
    finally:
        for r in remotes:
            r.close()
        for s in servers:
            s.close()
