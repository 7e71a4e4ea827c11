"""The physical KV block pool: ref counts, an LRU free-block queue and the prefix-cache map.

Anchored on vLLM v1 `core/block_pool.py` + `kv_cache_utils.py`. A block with `ref_cnt == 0`
sits in the free queue; if it still carries a block hash its K/V stays reusable until the
block is handed out again (evicted), oldest-freed first. Block hashes are chained and
deterministic (kvkeys/chain.py's `chain_hash` from a fixed root): identical across
processes, machines and PYTHONHASHSEED values.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvkeys.chain import chain_hash, root_hash

# The parent of the first block: a fixed seed, so chains never depend on process state.
NONE_HASH: bytes = root_hash(b"kvtier/engine/prefix-cache/v1")


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Returns the 16-byte hash of one block given its parent's hash (None for the first)."""
    return chain_hash(NONE_HASH if parent_hash is None else parent_hash, token_ids)


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, parent_hash: bytes | None = None, start: int = 0
) -> list[bytes]:
    """Returns the chained hashes of every full block of `token_ids[start:]`.

    `start` must be block aligned and `parent_hash` the hash of the block ending at `start`;
    a trailing partial block is not hashed.
    """
    if start % block_size:
        raise ValueError(f"start {start} is not a multiple of block_size {block_size}")
    hashes: list[bytes] = []
    for s in range(start, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block_tokens(parent_hash, token_ids[s : s + block_size])
        hashes.append(parent_hash)
    return hashes


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and registered in the prefix cache; cleared on eviction.
    block_hash: bytes | None = None
    # The tenant tag (kvkeys/tenants.py) of the salted request that registered it, else None.
    tenant: str | None = None
    # Links of the doubly linked free queue (None when not queued or at an end).
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks: O(1) popleft, append and removal from the middle.

    Eviction order is the queue order: the head was freed longest ago (LRU).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        """Returns and unlinks the least recently freed block; raises if empty."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise RuntimeError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlinks `block`, which must be queued."""
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Queues `block` at the tail (most recently freed, evicted last)."""
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Queues `block` at the head (handed out next)."""
        first = self._head.next_free
        assert first is not None
        self._head.next_free, block.prev_free = block, self._head
        block.next_free, first.prev_free = first, block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Returns queued block ids head to tail (for tests and stats)."""
        out, b = [], self._head.next_free
        while b is not None and b is not self._tail:
            out.append(b.block_id)
            b = b.next_free
        return out


class BlockPool:
    """Hands out, shares and reclaims physical blocks; owns the prefix-cache hash map.

    Guarantees: ref counts never go negative (freeing a free block raises), a block is in the
    free queue iff its ref count is zero, and a cached hash maps to exactly one block.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self._by_tenant: dict[str, set[int]] = {}  # tenant tag -> ids of its cached blocks

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        """Returns the fraction of blocks in use (ref count > 0)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """Returns the block holding K/V for `block_hash`, or None."""
        return self.cached.get(block_hash) if self.enable_caching else None

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Returns `n` blocks with ref count 1, evicting their old cached contents.

        Raises ValueError if fewer than `n` blocks are free (callers check first).
        """
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes one more reference on each block (a prefix-cache hit), unqueueing free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference per block; blocks reaching zero join the free queue: cached ones
        at its tail in the given order (so pass the eviction order: first freed = first
        evicted), uncached ones at its head, handed out before any cached block is evicted
        (and their memory is already written: a fresh CPU page costs a fault)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes, tenant: str | None = None) -> None:
        """Registers a full, computed block under `block_hash`, for `tenant` (a salted
        request's tag, so `forget_tenant` finds it) or None.

        If another block already holds that hash the map keeps it; this one stays uncached
        (it is freed and reused like any other block).
        """
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if tenant is not None:
            block.tenant = tenant
            self._by_tenant.setdefault(tenant, set()).add(block.block_id)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
        if block.tenant is not None:
            ids = self._by_tenant.get(block.tenant)
            if ids is not None:
                ids.discard(block.block_id)
                if not ids:
                    del self._by_tenant[block.tenant]
            block.tenant = None

    def forget_tenant(self, tenant: str) -> int:
        """Uncaches every block `tenant` registered, free or in use, so no later lookup finds
        them (a running request of that tenant registers its blocks again as it computes them).
        Returns how many blocks were uncached."""
        ids = sorted(self._by_tenant.get(tenant, ()))
        for i in ids:
            block = self.blocks[i]
            self._evict(block)
            if block.ref_cnt == 0:  # free and now uncached: reused first, as `free_blocks` does
                self.free_queue.remove(block)
                self.free_queue.appendleft(block)
        return len(ids)

    def tenant_blocks(self, tenant: str) -> int:
        """Returns how many cached blocks `tenant` registered."""
        return len(self._by_tenant.get(tenant, ()))

    def reset_prefix_cache(self) -> bool:
        """Forgets all cached hashes; returns False (and does nothing) while blocks are in use.
        The queue is then reversed: the blocks that were cached, most recently freed first,
        are handed out before blocks never used (their memory is written already)."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.tenant = None
        self.cached.clear()
        self._by_tenant.clear()
        order = self.free_queue.block_ids()
        self.free_queue = FreeKVCacheBlockQueue(self.blocks[i] for i in reversed(order))
        return True
