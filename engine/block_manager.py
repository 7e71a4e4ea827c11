"""Per-sequence block allocation and automatic prefix caching (vLLM v1 KVCacheManager style).

A sequence's block table maps its logical blocks to physical ones. Full blocks are hashed with
a chained hash (`block_pool.hash_full_blocks`) and registered once computed, so a later request
with the same prefix shares them instead of recomputing. The last prompt token is always
recomputed, because its logits are needed to sample the first new token.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceT

from engine.block_pool import NONE_HASH, BlockPool, KVCacheBlock, hash_full_blocks
from engine.sequence import Sequence
from kvkeys.tenants import salted_root, tenant_tag


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Allocates blocks to sequences and serves prefix-cache hits.

    Guarantees: a sequence's table always covers the tokens scheduled for it; freeing a sequence
    releases each of its references exactly once (its table is emptied); counters count tokens.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        # Prefix-cache counters in tokens (vLLM semantics: queries = tokens looked up).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _update_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Extends `seq.block_hashes` to cover the full blocks of its first `num_tokens` tokens."""
        have = len(seq.block_hashes)
        want = num_tokens // self.block_size
        if want <= have:
            return
        start = have * self.block_size
        # A salted request's chain starts from its salt's root (vLLM: the salt enters block 0).
        parent = seq.block_hashes[-1] if have else salted_root(NONE_HASH, seq.cache_salt)
        tokens = seq.token_ids_slice(start, want * self.block_size)
        seq.block_hashes.extend(hash_full_blocks(tokens, self.block_size, parent))

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVCacheBlock], int]:
        """Returns the longest run of cached blocks matching `seq`'s leading full blocks and the
        number of tokens they hold, never covering the last token. Takes no references."""
        if not self.enable_prefix_caching or seq.num_computed_tokens:
            return [], 0
        max_hit = seq.num_tokens - 1  # the last token's logits are needed: always recompute it
        self._update_hashes(seq, max_hit)
        blocks: list[KVCacheBlock] = []
        for h in seq.block_hashes[: max_hit // self.block_size]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def num_cached_prefix_tokens(self, token_ids: SequenceT[int], cache_salt: str | None = None) -> int:
        """Returns how many leading tokens of `token_ids` the prefix cache holds now for
        requests of `cache_salt` (whole blocks, never the last token). Read-only: takes no
        references, counts no query."""
        if not self.enable_prefix_caching or len(token_ids) < 2:
            return 0
        max_blocks = (len(token_ids) - 1) // self.block_size
        n = 0
        root = salted_root(NONE_HASH, cache_salt)
        for h in hash_full_blocks(list(token_ids[: max_blocks * self.block_size]), self.block_size, root):
            if self.pool.get_cached_block(h) is None:
                break
            n += 1
        return n * self.block_size

    def record_prefix_lookup(self, num_queried: int, num_hit: int) -> None:
        """Counts one admitted request's lookup (called once per admission, not per retry)."""
        self.prefix_cache_queries += num_queried
        self.prefix_cache_hits += num_hit

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        computed_blocks: SequenceT[KVCacheBlock] = (),
        num_external_tokens: int = 0,
    ) -> list[int] | None:
        """Grows `seq`'s table to hold its computed tokens, `computed_blocks` (prefix-cache hits
        for a sequence being admitted), `num_external_tokens` (a connector will load these) and
        `num_new_tokens`. Returns the block table, or None (changing nothing) if short of blocks."""
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        total = num_computed + num_external_tokens + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(seq.block_table) - len(computed_blocks)
        # Hits sitting in the free queue stop being allocatable once we take them.
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_evictable_hits > self.pool.num_free_blocks:
            return None
        if computed_blocks:
            self.pool.touch(computed_blocks)
            seq.block_table.extend(b.block_id for b in computed_blocks)
        if num_new_blocks > 0:
            seq.block_table.extend(b.block_id for b in self.pool.get_new_blocks(num_new_blocks))
        return seq.block_table

    def cache_blocks(self, seq: Sequence) -> None:
        """Registers `seq`'s full blocks whose K/V is computed (first `num_computed_tokens`, capped
        at `max_cacheable_tokens`)."""
        if not self.enable_prefix_caching:
            return
        computed = seq.num_computed_tokens
        if seq.max_cacheable_tokens is not None:  # approximate K/V past it must never be shared
            computed = min(computed, seq.max_cacheable_tokens)
        self._update_hashes(seq, computed)
        num_full = computed // self.block_size
        tenant = tenant_tag(seq.cache_salt) if seq.cache_salt is not None else None
        for block_id, h in zip(seq.block_table[:num_full], seq.block_hashes[:num_full]):
            self.pool.cache_full_block(self.pool.blocks[block_id], h, tenant)

    def free(self, seq: Sequence) -> None:
        """Releases `seq`'s blocks, tail first, so its prefix is the last to be evicted."""
        blocks = [self.pool.blocks[i] for i in reversed(seq.block_table)]
        seq.block_table = []
        self.pool.free_blocks(blocks)

    def ref_counts(self) -> list[int]:
        return [b.ref_cnt for b in self.pool.blocks]
