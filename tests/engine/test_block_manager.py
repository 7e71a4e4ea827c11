"""Block manager: allocation and automatic prefix caching (slots: tests/engine/test_kv_cache.py)."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def seq_of(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(temperature=0))


def run_prefill(bm: BlockManager, seq: Sequence) -> int:
    """Admits `seq` with its prefix-cache hits, 'computes' the rest, caches; returns hits."""
    hits, n = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - n, hits) is not None
    bm.record_prefix_lookup(seq.num_tokens, n)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_blocks(seq)
    return n


def test_repeat_prompt_hits_all_full_blocks_but_the_last_token() -> None:
    bm = BlockManager(num_blocks=10, block_size=16)
    prompt = list(range(100, 150))  # 50 tokens: 3 full blocks
    first = seq_of(prompt, "a")
    assert run_prefill(bm, first) == 0
    bm.free(first)
    second = seq_of(prompt, "b")
    assert run_prefill(bm, second) == 48
    assert second.block_table[:3] == first_table_prefix(bm, prompt)
    # Exactly block-aligned prompt: the last block cannot be a hit (last token recomputed).
    bm.free(second)
    aligned = seq_of(prompt[:32], "c")
    assert run_prefill(bm, aligned) == 16
    bm.free(aligned)
    assert bm.prefix_cache_queries == 50 + 50 + 32 and bm.prefix_cache_hits == 48 + 16
    assert set(bm.ref_counts()) == {0}


def first_table_prefix(bm: BlockManager, prompt: list[int]) -> list[int]:
    probe = seq_of(prompt, "probe")
    hits, _ = bm.get_computed_blocks(probe)
    return [b.block_id for b in hits]


def test_shared_prefix_blocks_are_shared_and_refcounted() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    run_prefill(bm, a)
    b = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 42, 43], "b")
    assert run_prefill(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.pool.blocks[i].ref_cnt for i in a.block_table[:2]] == [2, 2]
    bm.free(a)
    bm.free(b)
    assert set(bm.ref_counts()) == {0} and bm.num_free_blocks == 10


def test_allocate_fails_without_side_effects_when_short() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    a = seq_of(list(range(8)), "a")
    assert bm.allocate_slots(a, 8) is not None
    b = seq_of(list(range(50, 58)), "b")
    free_before = bm.num_free_blocks
    assert bm.allocate_slots(b, 8) is None
    assert b.block_table == [] and bm.num_free_blocks == free_before
    # Growing one token at a time adds a block only at block boundaries.
    a.num_computed_tokens = 8
    a.output_token_ids.append(7)
    assert len(bm.allocate_slots(a, 1)) == 3
    bm.free(a)
    assert set(bm.ref_counts()) == {0}


def test_evictable_hits_count_against_free_blocks() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    a = seq_of(list(range(9)), "a")
    run_prefill(bm, a)
    bm.free(a)  # 2 cached blocks now free but reusable
    b = seq_of(list(range(9)), "b")
    hits, n = bm.get_computed_blocks(b)
    assert n == 8
    # 2 hits taken out of the free queue + 1 new block = all 3; asking for 2 more tokens of
    # a fourth block must fail.
    assert bm.allocate_slots(b, 5, hits) is None
    assert bm.allocate_slots(b, 1, hits) is not None
    bm.free(b)
    assert set(bm.ref_counts()) == {0}


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a = seq_of(list(range(20)), "a")
    run_prefill(bm, a)
    bm.free(a)
    assert run_prefill(bm, seq_of(list(range(20)), "b")) == 0
    assert not bm.pool.cached


def test_num_cached_prefix_tokens_is_a_read_only_lookup() -> None:
    bm = BlockManager(num_blocks=10, block_size=16)
    tokens = list(range(100, 150))  # 50 tokens: 3 full blocks
    assert bm.num_cached_prefix_tokens(tokens) == 0
    first = seq_of(tokens, "a")
    run_prefill(bm, first)
    bm.free(first)
    queries, refs = bm.prefix_cache_queries, bm.ref_counts()
    assert bm.num_cached_prefix_tokens(tokens) == 48
    assert bm.num_cached_prefix_tokens(tokens[:48]) == 32  # never the last token
    assert bm.num_cached_prefix_tokens(tokens[:20] + [7] * 30) == 16  # diverges in block 2
    assert (bm.prefix_cache_queries, bm.ref_counts()) == (queries, refs)  # no side effects
    assert run_prefill(bm, seq_of(tokens, "b")) == 48  # what the engine then really finds
