"""Gather/scatter between paged kv_caches and chunk tensors: exact for any alignment."""

from __future__ import annotations

import pytest
import torch

from connector.gather import gather_chunk, scatter_chunk, slots_for

NUM_LAYERS, H, D = 3, 2, 4


def _caches(num_blocks: int, block_size: int, dtype: torch.dtype, stacked: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_LAYERS, 2, num_blocks, block_size, H, D)
    whole = torch.randn(shape, generator=g).to(dtype)
    if stacked:
        return list(whole.unbind(0))  # views of one allocation: the fast path
    return [whole[i].clone() for i in range(NUM_LAYERS)]  # separate allocations


def _reference_gather(caches, block_table, block_size, start, end):
    """Per-token reference written the slow, obvious way."""
    out = []
    for kv in caches:
        toks = [kv[:, block_table[p // block_size], p % block_size] for p in range(start, end)]
        out.append(torch.stack(toks, dim=1))
    return torch.stack(out, dim=0)


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "chunk_size,block_size,num_tokens,start",
    [
        (256, 16, 700, 0),  # several full chunks + partial last
        (48, 16, 200, 0),  # chunk is 3 blocks
        (16, 32, 90, 0),  # chunk smaller than a block
        (48, 16, 171, 8),  # chunks start mid-block
        (256, 16, 40, 0),  # only a partial chunk
        (7, 5, 53, 3),  # odd sizes
    ],
)
def test_round_trip_exact(chunk_size, block_size, num_tokens, start, dtype, stacked):
    seq_len = start + num_tokens
    num_seq_blocks = -(-seq_len // block_size)
    num_blocks = num_seq_blocks * 2 + 3
    g = torch.Generator().manual_seed(chunk_size * 1000 + block_size)
    table = torch.randperm(num_blocks, generator=g)[:num_seq_blocks].tolist()  # random, scattered
    src = _caches(num_blocks, block_size, dtype, stacked, seed=1)
    dst = _caches(num_blocks, block_size, dtype, stacked, seed=2)
    dst_before = [kv.clone() for kv in dst]

    chunks = []
    for s in range(start, seq_len, chunk_size):
        e = min(s + chunk_size, seq_len)
        slots = slots_for(table, block_size, s, e)
        chunk = gather_chunk(src, slots)
        assert chunk.shape == (NUM_LAYERS, 2, e - s, H, D)
        assert chunk.dtype == dtype and chunk.is_contiguous()
        assert torch.equal(chunk, _reference_gather(src, table, block_size, s, e))
        chunks.append((slots, chunk))

    for slots, chunk in chunks:
        scatter_chunk(dst, slots, chunk)

    # Exactly the sequence's slots took the source values; every other slot is untouched.
    touched = slots_for(table, block_size, start, seq_len)
    mask = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    mask[touched] = True
    for layer in range(NUM_LAYERS):
        got = dst[layer].reshape(2, -1, H, D)
        want_src = src[layer].reshape(2, -1, H, D)
        before = dst_before[layer].reshape(2, -1, H, D)
        assert torch.equal(got[:, mask], want_src[:, mask])
        assert torch.equal(got[:, ~mask], before[:, ~mask])


def test_stacked_scatter_writes_through_to_layer_views():
    whole = torch.zeros(NUM_LAYERS, 2, 4, 8, H, D)
    caches = list(whole.unbind(0))
    slots = slots_for([2, 0], 8, 3, 12)
    chunk = torch.randn(NUM_LAYERS, 2, 9, H, D)
    scatter_chunk(caches, slots, chunk)
    assert torch.equal(gather_chunk(caches, slots), chunk)
    assert torch.equal(whole[1, :, 2, 3:8], chunk[1, :, :5])


def test_scatter_casts_dtype():
    caches = _caches(4, 4, torch.float16, stacked=False)
    slots = slots_for([3, 1], 4, 0, 6)
    chunk = torch.randn(NUM_LAYERS, 2, 6, H, D)
    scatter_chunk(caches, slots, chunk)
    assert torch.equal(gather_chunk(caches, slots), chunk.half())


def test_slots_for_values():
    assert slots_for([5, 2, 9], 4, 2, 10).tolist() == [22, 23, 8, 9, 10, 11, 36, 37]
    assert slots_for([5], 4, 1, 1).numel() == 0


def test_bad_input_raises_and_changes_nothing():
    caches = _caches(4, 4, torch.float32, stacked=True)
    before = [kv.clone() for kv in caches]
    with pytest.raises(ValueError, match="exceeds"):
        slots_for([0, 1], 4, 0, 9)
    with pytest.raises(ValueError, match="start"):
        slots_for([0, 1], 4, 5, 2)
    with pytest.raises(ValueError, match="chunk shape"):
        scatter_chunk(caches, slots_for([0, 1], 4, 0, 5), torch.zeros(NUM_LAYERS, 2, 4, H, D))
    with pytest.raises(ValueError, match="slot range"):
        scatter_chunk(caches, torch.tensor([0, 99]), torch.zeros(NUM_LAYERS, 2, 2, H, D))
    with pytest.raises(ValueError, match="slot range"):
        gather_chunk(caches, torch.tensor([-1]))
    with pytest.raises(ValueError, match="empty"):
        gather_chunk([], torch.tensor([0]))
    for a, b in zip(caches, before):
        assert torch.equal(a, b)
