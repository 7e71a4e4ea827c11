"""The paged KV layout: slots, bytes, and gather/scatter between the paged caches and chunk
tensors, exact for any alignment."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import (
    EngineLayout,
    PagedKVLayout,
    consecutive_start,
    kv_bytes_per_block,
    layout_for,
    request_slots,
    slot_mapping,
)
from engine.model_config import ModelConfig

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


@pytest.mark.parametrize("stacked,dtype,adjacent", [
    (True, torch.float32, False), (True, torch.float16, False), (False, torch.float32, False),
    (False, torch.float16, False),
    (True, torch.float32, True),  # one run of slots: the stacked layout copies it whole
])
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
def test_round_trip_exact(chunk_size, block_size, num_tokens, start, dtype, stacked, adjacent):
    seq_len = start + num_tokens
    num_seq_blocks = -(-seq_len // block_size)
    num_blocks = num_seq_blocks * 2 + 3
    g = torch.Generator().manual_seed(chunk_size * 1000 + block_size)
    table = torch.randperm(num_blocks, generator=g)[:num_seq_blocks].tolist()  # random, scattered
    if adjacent:
        table = list(range(3, 3 + num_seq_blocks))
    src = _caches(num_blocks, block_size, dtype, stacked, seed=1)
    dst = _caches(num_blocks, block_size, dtype, stacked, seed=2)
    dst_before = [kv.clone() for kv in dst]
    src_layout, dst_layout = layout_for(src), layout_for(dst)

    chunks = []
    for s in range(start, seq_len, chunk_size):
        e = min(s + chunk_size, seq_len)
        slots = src_layout.slots(table, s, e)
        chunk = src_layout.gather_chunk(slots)
        assert chunk.shape == (NUM_LAYERS, 2, e - s, H, D)
        assert chunk.dtype == dtype and chunk.is_contiguous()
        assert torch.equal(chunk, _reference_gather(src, table, block_size, s, e))
        chunks.append((slots, chunk))

    for slots, chunk in chunks:
        dst_layout.scatter_chunk(slots, chunk)

    # Exactly the sequence's slots took the source values; every other slot is untouched.
    touched = request_slots(table, block_size, start, seq_len)
    mask = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    mask[touched] = True
    for layer in range(NUM_LAYERS):
        got = dst[layer].reshape(2, -1, H, D)
        want_src = src[layer].reshape(2, -1, H, D)
        before = dst_before[layer].reshape(2, -1, H, D)
        assert torch.equal(got[:, mask], want_src[:, mask])
        assert torch.equal(got[:, ~mask], before[:, ~mask])


@pytest.mark.parametrize("stacked", [True, False])
def test_layerwise_round_trip_matches_the_chunk(stacked):
    src = layout_for(_caches(6, 4, torch.float32, stacked, seed=1))
    dst_caches = _caches(6, 4, torch.float32, stacked, seed=2)
    dst = layout_for(dst_caches)
    slots = src.slots([4, 0, 5], 1, 11)
    layers = src.gather_layers(slots)
    assert [tuple(t.shape) for t in layers] == [(1, 2, 10, H, D)] * NUM_LAYERS
    assert torch.equal(torch.cat(layers), src.gather_chunk(slots))
    for i, t in enumerate(layers):
        dst.scatter_layer(i, slots, t[0].double())  # cast back to the cache dtype
    assert torch.equal(dst.gather_chunk(slots), src.gather_chunk(slots))
    with pytest.raises(ValueError, match="layer shape"):
        dst.scatter_layer(0, slots, layers[0])
    with pytest.raises(ValueError, match="outside"):
        dst.scatter_layer(NUM_LAYERS, slots, layers[0][0])


def test_stacked_scatter_writes_through_to_layer_views():
    whole = torch.zeros(NUM_LAYERS, 2, 4, 8, H, D)
    layout = layout_for(list(whole.unbind(0)))
    slots = layout.slots([2, 0], 3, 12)
    chunk = torch.randn(NUM_LAYERS, 2, 9, H, D)
    layout.scatter_chunk(slots, chunk)
    assert torch.equal(layout.gather_chunk(slots), chunk)
    assert torch.equal(whole[1, :, 2, 3:8], chunk[1, :, :5])


def test_consecutive_start_finds_one_run_only():
    assert consecutive_start(torch.arange(40, 72)) == 40
    assert consecutive_start(torch.tensor([7])) == 7
    assert consecutive_start(torch.tensor([3, 4, 6, 5, 7])) is None  # right ends, not one run
    assert consecutive_start(torch.tensor([3, 5])) is None
    assert consecutive_start(torch.tensor([], dtype=torch.long)) is None


def test_a_gathered_run_is_a_new_tensor():
    layout = layout_for(_caches(4, 4, torch.float32, stacked=True))
    slots = layout.slots([1, 2], 0, 8)
    chunk = layout.gather_chunk(slots)
    chunk.zero_()
    assert not torch.equal(layout.gather_chunk(slots), chunk)


def test_scatter_casts_dtype():
    layout = layout_for(_caches(4, 4, torch.float16, stacked=False))
    slots = layout.slots([3, 1], 0, 6)
    chunk = torch.randn(NUM_LAYERS, 2, 6, H, D)
    layout.scatter_chunk(slots, chunk)
    assert torch.equal(layout.gather_chunk(slots), chunk.half())


def test_slots_values():
    assert request_slots([5, 2, 9], 4, 2, 10).tolist() == [22, 23, 8, 9, 10, 11, 36, 37]
    assert request_slots([5], 4, 1, 1).numel() == 0
    assert request_slots([5, 2], 16, 14, 18).tolist() == [94, 95, 32, 33]
    layout = layout_for(_caches(10, 4, torch.float32, stacked=True))
    assert layout.slots([5, 2, 9], 2, 10).tolist() == [22, 23, 8, 9, 10, 11, 36, 37]


def test_slot_mapping_matches_the_formula() -> None:
    tables = torch.tensor([[5, 2, 9], [1, 0, 0]])
    seq_index = torch.tensor([0] * 40 + [1] * 3)
    positions = torch.tensor(list(range(40)) + [13, 14, 15])
    got = slot_mapping(tables, seq_index, positions, 16).tolist()
    want = [tables[s, p // 16].item() * 16 + p % 16 for s, p in zip(seq_index.tolist(), positions.tolist())]
    assert got == want
    layout = layout_for([torch.zeros(2, 10, 16, H, D)])
    assert layout.slot_mapping(tables, seq_index, positions).tolist() == want
    with pytest.raises(ValueError):
        request_slots([5], 16, 10, 17)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bytes_agree_with_the_allocated_tensors(dtype):
    caches = _caches(5, 4, dtype, stacked=False)
    layout = layout_for(caches)
    assert isinstance(layout, PagedKVLayout)
    dims = (layout.num_layers, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_size)
    assert dims == (NUM_LAYERS, 5, 4, H, D)
    assert (layout.dtype, layout.device) == (dtype, caches[0].device)
    allocated = sum(kv.numel() * kv.element_size() for kv in caches)
    assert layout.bytes_per_block() * layout.num_blocks == allocated
    assert layout.bytes_per_token() * layout.block_size == layout.bytes_per_block()
    assert layout.gather_chunk(layout.slots([0], 0, 1)).nbytes == layout.bytes_per_token()
    assert kv_bytes_per_block(layout, layout.block_size, dtype) == layout.bytes_per_block()


def test_bytes_per_block_from_a_model_config_matches_the_engine_pool(default_model_path):
    mc = ModelConfig.from_pretrained(default_model_path)
    shape = (2, 3, 16, mc.num_kv_heads, mc.head_size)
    layout = layout_for([torch.zeros(shape, dtype=torch.float16) for _ in range(mc.num_layers)])
    assert kv_bytes_per_block(mc, 16, torch.float16) == layout.bytes_per_block()


def test_bad_input_raises_and_changes_nothing():
    caches = _caches(4, 4, torch.float32, stacked=True)
    before = [kv.clone() for kv in caches]
    layout = layout_for(caches)
    with pytest.raises(ValueError, match="exceeds"):
        layout.slots([0, 1], 0, 9)
    with pytest.raises(ValueError, match="start"):
        layout.slots([0, 1], 5, 2)
    with pytest.raises(ValueError, match="chunk shape"):
        layout.scatter_chunk(layout.slots([0, 1], 0, 5), torch.zeros(NUM_LAYERS, 2, 4, H, D))
    with pytest.raises(ValueError, match="slot range"):
        layout.scatter_chunk(torch.tensor([0, 99]), torch.zeros(NUM_LAYERS, 2, 2, H, D))
    with pytest.raises(ValueError, match="slot range"):
        layout.gather_chunk(torch.tensor([-1]))
    with pytest.raises(ValueError, match="empty"):
        layout_for([])
    with pytest.raises(ValueError, match="num_blocks"):
        EngineLayout([torch.zeros(3, 4, 4, H, D)])
    with pytest.raises(ValueError, match="differs"):
        EngineLayout([caches[0], caches[1].half()])
    for a, b in zip(caches, before):
        assert torch.equal(a, b)


def test_non_contiguous_caches_gather_but_refuse_scatter():
    whole = torch.randn(2, 4, 4, H, 2 * D)
    caches = [whole[..., :D], whole[..., D:]]  # not contiguous: a reshape would copy
    layout = layout_for(caches)
    slots = layout.slots([1, 3], 2, 7)
    assert torch.equal(layout.gather_chunk(slots), _reference_gather(caches, [1, 3], 4, 2, 7))
    with pytest.raises(ValueError, match="contiguous"):
        layout.scatter_chunk(slots, torch.zeros(2, 2, 5, H, D))
    with pytest.raises(ValueError, match="contiguous"):
        layout.scatter_layer(0, slots, torch.zeros(2, 5, H, D))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeroed_pool_is_zero_contiguous_and_aligned(dtype: torch.dtype) -> None:
    from engine.kv_cache import zeroed_pool

    pool = zeroed_pool((3, 2, 5, 16, 3, 64), dtype, torch.device("cpu"))
    assert pool.shape == (3, 2, 5, 16, 3, 64) and pool.dtype == dtype and pool.is_contiguous()
    assert pool.data_ptr() % 64 == 0 and not pool.any()
    pool[1, 0, 2] = 1.5  # writable, and every view of a layer lands in the one allocation
    layers = pool.unbind(0)
    assert layers[1].untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()
    assert float(pool.float().sum()) == 1.5 * 16 * 3 * 64
