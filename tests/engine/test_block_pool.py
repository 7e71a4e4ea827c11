"""Block pool: deterministic chained hashes, LRU free queue, ref counts, cache map."""

from __future__ import annotations

import os
import sys

import pytest

from engine.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, hash_block_tokens, hash_full_blocks
from harness import process

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_hash_is_chained_and_content_sensitive() -> None:
    a = hash_full_blocks(list(range(48)), 16)
    assert len(a) == 3 and len(set(a)) == 3
    assert all(isinstance(h, bytes) and len(h) == 16 for h in a)
    # Same block content under a different parent hashes differently (chaining).
    b = hash_full_blocks([99] * 16 + list(range(16, 48)), 16)
    assert a[0] != b[0] and a[1] != b[1] and a[2] != b[2]
    assert a[1] == hash_block_tokens(a[0], list(range(16, 32)))
    # A trailing partial block is not hashed; resuming from a parent extends the same chain.
    assert hash_full_blocks(list(range(40)), 16) == a[:2]
    assert hash_full_blocks(list(range(48)), 16, parent_hash=a[0], start=16)[-1] == a[2]


def test_hash_identical_across_processes_and_hashseeds() -> None:
    code = "from engine.block_pool import hash_full_blocks; print(hash_full_blocks(list(range(64)), 16)[-1].hex())"
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": REPO}
        outs.add(
            process.run(
                [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True, timeout=120
            ).stdout.strip()
        )
    assert outs == {hash_full_blocks(list(range(64)), 16)[-1].hex()}


def test_free_queue_is_lru_and_supports_removal() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4] and q.num_free_blocks == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    assert q.block_ids() == [1, 3, 4, 0]
    with pytest.raises(RuntimeError):
        q.remove(blocks[2])  # not queued


def test_ref_counts_never_negative_and_free_order_is_eviction_order() -> None:
    pool = BlockPool(4)
    got = pool.get_new_blocks(3)
    assert [b.ref_cnt for b in got] == [1, 1, 1] and pool.num_free_blocks == 1
    for i, b in enumerate(got):
        pool.cache_full_block(b, hash_block_tokens(None, [i]))
    pool.touch([got[0]])
    assert got[0].ref_cnt == 2
    pool.free_blocks([got[2], got[1], got[0]])
    assert [b.ref_cnt for b in got] == [1, 0, 0]
    assert pool.free_queue.block_ids() == [3, 2, 1]
    pool.free_blocks([got[0]])
    with pytest.raises(RuntimeError, match="ref_cnt 0"):
        pool.free_blocks([got[0]])
    assert all(b.ref_cnt == 0 for b in pool.blocks) and pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="only 4 free"):
        pool.get_new_blocks(5)


def test_uncached_blocks_are_handed_out_before_cached_ones_are_evicted() -> None:
    """A freed block without cached K/V is worth nothing to the prefix cache: it is reused
    first (so no cached block is evicted while one exists, and its memory is already written)."""
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_block(a, hash_block_tokens(None, [1]))
    pool.free_blocks([a, b, c])  # b, c uncached: to the head
    assert pool.free_queue.block_ids() == [2, 1, 3, 0]
    assert [blk.block_id for blk in pool.get_new_blocks(3)] == [2, 1, 3]
    assert pool.get_cached_block(hash_block_tokens(None, [1])) is a  # still cached
    pool.free_blocks(pool.blocks[1:])
    pool.forget_tenant("nobody")
    # A reset reverses the queue: what was cached (at the tail), most recently freed first.
    assert pool.reset_prefix_cache()
    assert pool.free_queue.block_ids() == [0, 1, 2, 3]
    assert pool.get_cached_block(hash_block_tokens(None, [1])) is None


def test_a_forgotten_tenants_free_blocks_are_reused_first() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    for i, blk in enumerate(blocks):
        pool.cache_full_block(blk, hash_block_tokens(None, [i]), tenant="t" if i == 2 else None)
    pool.free_blocks(blocks)
    assert pool.free_queue.block_ids() == [0, 1, 2]
    assert pool.forget_tenant("t") == 1
    assert pool.free_queue.block_ids() == [2, 0, 1] and pool.num_free_blocks == 3


def test_cached_block_is_reused_until_evicted() -> None:
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_full_block(b, h)
    pool.free_blocks([b])
    assert pool.get_cached_block(h) is b  # still holds its K/V while free
    pool.touch([b])  # a hit takes it out of the free queue
    assert pool.num_free_blocks == 1 and b.ref_cnt == 1
    pool.free_blocks([b])
    # Allocating every block evicts the cached one: its hash is forgotten.
    pool.get_new_blocks(2)
    assert pool.get_cached_block(h) is None and b.block_hash is None


def test_duplicate_hash_keeps_first_block_and_caching_off_caches_nothing() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [7] * 4)
    pool.cache_full_block(a, h)
    pool.cache_full_block(b, h)
    assert pool.get_cached_block(h) is a and b.block_hash is None
    off = BlockPool(2, enable_caching=False)
    (c,) = off.get_new_blocks(1)
    off.cache_full_block(c, h)
    assert off.get_cached_block(h) is None


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_block(b, b"x" * 16)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True and pool.get_cached_block(b"x" * 16) is None


def test_pool_needs_a_block() -> None:
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        BlockPool(0)
