"""`cache_salt` in the engine's prefix cache: salts never share a block, one salt shares as
before, unsalted hashes are byte-identical to those before salts existed, and a tenant's
blocks can be forgotten without touching anyone else's."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.block_pool import hash_full_blocks
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from kvkeys.tenants import (
    salted_root,
    set_tenant_tag_key,
    tenant_tag,
    tenant_tag_keyed,
    validate_cache_salt,
)

PROMPT = list(range(100, 150))  # 50 tokens: 3 full blocks of 16, the last token recomputed

# Computed by the code before salts existed (commit e936ad1): stored state stays valid.
GOLDEN_BLOCK_HASHES = ["7227764e18dea6b4000408921538b99f", "66e2852336d75e50186322ab3393c839"]


def seq_of(tokens: list[int], rid: str, salt: str | None = None) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(temperature=0), cache_salt=salt)


def prefill(bm: BlockManager, seq: Sequence) -> int:
    """Admits `seq` with its prefix-cache hits, 'computes' the rest, caches; returns hits."""
    hits, n = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - n, hits) is not None
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_blocks(seq)
    return n


def test_unsalted_block_hashes_are_unchanged() -> None:
    assert [h.hex() for h in hash_full_blocks(list(range(10)), 4)] == GOLDEN_BLOCK_HASHES
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = seq_of(list(range(10)), "a")
    prefill(bm, seq)
    assert [h.hex() for h in seq.block_hashes] == GOLDEN_BLOCK_HASHES


def test_salts_never_share_blocks_same_salt_does() -> None:
    bm = BlockManager(num_blocks=32, block_size=16)
    runs = [("a1", "tenant-a"), ("b1", "tenant-b"), ("n1", None), ("a2", "tenant-a"), ("b2", "tenant-b"),
            ("n2", None)]
    hits = {}
    for rid, salt in runs:
        seq = seq_of(PROMPT, rid, salt)
        hits[rid] = prefill(bm, seq)
        bm.free(seq)
    assert hits == {"a1": 0, "b1": 0, "n1": 0, "a2": 48, "b2": 48, "n2": 48}
    # Every salt's chain differs from the first block on.
    a, b, n = (seq_of(PROMPT, "x", s) for s in ("tenant-a", "tenant-b", None))
    for s in (a, b, n):
        bm.get_computed_blocks(s)
    assert all(len({x, y, z}) == 3 for x, y, z in zip(a.block_hashes, b.block_hashes, n.block_hashes))
    assert len(bm.pool.cached) == 9
    assert bm.num_cached_prefix_tokens(PROMPT, "tenant-a") == 48
    assert bm.num_cached_prefix_tokens(PROMPT, "tenant-c") == 0


def test_forget_tenant_uncaches_only_its_blocks() -> None:
    bm = BlockManager(num_blocks=32, block_size=16)
    for rid, salt in (("a", "tenant-a"), ("b", "tenant-b"), ("n", None)):
        seq = seq_of(PROMPT, rid, salt)
        prefill(bm, seq)
        bm.free(seq)
    assert bm.pool.tenant_blocks(tenant_tag("tenant-a")) == 3
    assert bm.pool.forget_tenant(tenant_tag("tenant-a")) == 3
    assert bm.pool.forget_tenant(tenant_tag("tenant-a")) == 0
    assert bm.num_cached_prefix_tokens(PROMPT, "tenant-a") == 0
    assert bm.num_cached_prefix_tokens(PROMPT, "tenant-b") == 48
    assert bm.num_cached_prefix_tokens(PROMPT, None) == 48
    # A block evicted by reuse leaves the tenant's record too.
    seq = seq_of(PROMPT, "b2", "tenant-b")
    bm.get_computed_blocks(seq)
    bm.pool.get_new_blocks(bm.num_free_blocks)
    assert bm.pool.tenant_blocks(tenant_tag("tenant-b")) == 0 and not bm.pool.cached


def test_salt_roots_and_tags() -> None:
    root = b"\x01" * 16
    assert salted_root(root, None) == root
    assert len({salted_root(root, "a"), salted_root(root, "b"), root}) == 3
    tag = tenant_tag("a")
    assert len(tag) == 16 and int(tag, 16) >= 0 and "a" != tag and tenant_tag("a") == tag


@pytest.mark.parametrize("bad", ["", 5, "x" * 129, "a/b", "a@b", "a\\b", "a\x00"])
def test_invalid_salts_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="cache_salt"):
        validate_cache_salt(bad)
    assert validate_cache_salt("tenant-1") == "tenant-1" and validate_cache_salt(None) is None


# Computed by the code before keyed tags (commit c17f606): without a key, tags are unchanged.
GOLDEN_TAGS = {"tenant-a": "a78b3cf5f152dad8", "tenant-b": "65c8194b1b9501ff"}
SECRET, OTHER_SECRET = "operator secret, 32 bytes long..", "another secret, 32 bytes long..."


def test_keyed_tags() -> None:
    """Same salt and key: the same tag; another key: another tag; no key: today's tag. The
    process key (set_tenant_tag_key) is what tenant_tag uses by default, and is removable."""
    assert {s: tenant_tag(s) for s in GOLDEN_TAGS} == GOLDEN_TAGS
    keyed = tenant_tag("tenant-a", SECRET)
    assert keyed == tenant_tag("tenant-a", SECRET.encode()) and len(keyed) == 16 and int(keyed, 16) >= 0
    assert keyed not in (GOLDEN_TAGS["tenant-a"], tenant_tag("tenant-a", OTHER_SECRET), tenant_tag("tenant-b", SECRET))
    try:
        set_tenant_tag_key(SECRET)
        assert tenant_tag_keyed() and tenant_tag("tenant-a") == keyed
        assert tenant_tag("tenant-a", OTHER_SECRET) == tenant_tag("tenant-a", OTHER_SECRET)
    finally:
        set_tenant_tag_key(None)
    assert not tenant_tag_keyed() and tenant_tag("tenant-a") == GOLDEN_TAGS["tenant-a"]
    with pytest.raises(ValueError, match="at least 16 bytes"):
        set_tenant_tag_key("short")
    assert not tenant_tag_keyed()
