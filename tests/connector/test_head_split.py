"""Chunks split by KV head (vLLM's connector at any tensor-parallel size): each head is its own
stored value, a rank's keyspace covers its heads, ranks split heads as vLLM does, and a chunk
counts as held only when every rank holds its heads of it."""

from __future__ import annotations

import pytest
import torch

from connector.presence import LocalHeldKeys, Presence, held_tokens
from connector.vllm.setup import rank_heads
from kvkeys.keyspace import Keyspace, head_key
from kvstore.backends.memory import CPUBackend
from kvstore.storage_manager import StorageManager

KS = Keyspace("m", torch.float32, 4, num_layers=2, heads=(0, 4))


def test_each_head_of_a_chunk_is_its_own_value_and_a_rank_covers_its_heads() -> None:
    spans = KS.spans(list(range(8)))
    assert KS.stored_keys(spans) == [head_key(sp.key, h) for sp in spans for h in range(4)]
    rank1 = KS.for_heads(2, 4)
    assert KS.for_heads(2, 4) is rank1  # built once per range: every lookup asks it of every rank
    assert rank1.values_per_chunk == 2 and rank1.spans(list(range(8))) == spans  # the same chunk keys
    assert rank1.probe_keys(spans) == [head_key(sp.key, 3) for sp in spans]
    salted = rank1.for_salt("tenant")
    assert salted.heads == (2, 4) and salted.stored_keys(salted.spans([1]))[0].endswith("@H2")
    kv = torch.randn(2, 2, 4, 2, 8)  # rank 1's heads of one chunk
    values = rank1.chunk_values("k", kv)
    assert [k for k, _ in values] == ["k@H2", "k@H3"]
    assert torch.equal(torch.cat([v for _, v in values], dim=3), kv)
    assert all(v.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr() for _, v in values)  # no copy
    with pytest.raises(ValueError, match="by layer .* or by KV head"):
        Keyspace("m", torch.float32, 4, num_layers=2, layerwise=True, heads=(0, 1))


@pytest.mark.parametrize("heads, tp, ranges", [
    (4, 1, [(0, 4)]),
    (4, 2, [(0, 2), (2, 4)]),
    (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),  # more ranks than heads: each head on two ranks
])
def test_ranks_hold_the_heads_vllm_gives_them(heads: int, tp: int, ranges: list[tuple[int, int]]) -> None:
    assert [rank_heads(heads, tp, r) for r in range(tp)] == ranges


def test_an_uneven_split_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="3 KV heads do not split evenly over 2 ranks"):
        rank_heads(3, 2, 0)


def test_a_chunk_is_held_when_every_rank_holds_its_heads() -> None:
    tiers = [StorageManager([CPUBackend(byte_budget=1 << 20)]) for _ in range(2)]  # each rank's own cpu tier
    spans = KS.spans(list(range(12)))  # three chunks
    ranks = [LocalHeldKeys(t) for t in tiers]
    ranked = Presence(ranks, [(0, 2), (2, 4)])
    value = torch.zeros(2, 2, 4, 1, 8)
    for r, (lo, hi) in enumerate([(0, 2), (2, 4)]):
        chunks = spans if r == 0 else spans[:2]  # rank 1 stored only the first two chunks
        tiers[r].batched_put([(k, value) for k in KS.for_heads(lo, hi).stored_keys(chunks)])
    assert ranked.chunks_held(KS, spans) == [True, True, False]
    runs = ranked.tier_prefix_chunks(KS, spans)
    assert list(runs.values()) == [2]
    assert held_tokens(spans, runs, 12) == {next(iter(runs)): 8}
    found = ranked.find(KS, list(range(12)), 0, spans, KS.root, 0)  # the planner's lookup
    assert found.tiers == [0, 0] and found.partial is None
