"""vLLM's paged layouts behind PagedKVLayout (connector/vllm/layouts.py), on CPU tensors of
each backend's shape and vLLM's stride orders, against an oracle that reads and writes one
(slot, head) at a time by the layout's formula. (tests/vllm/test_cpu_layout_kernel.py checks
the CPU formula against vLLM's own kernels.)"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType

import pytest
import torch

from connector.vllm.layouts import VllmAmxLayout, VllmCpuLayout, VllmFlashLayout, VllmTileLayout, vllm_layout_for
from engine.kv_cache import EngineLayout, PagedKVLayout

L, NB, H, BS, D = 3, 6, 2, 8, 4
SLOTS = torch.tensor([0, 5, 9, 17, 47, 40, 23], dtype=torch.long)  # across blocks, out of order
SIZES = {"L": L, "B": NB, "H": H, "N": BS, "C": 2 * D}


def vllm_caches(order: str, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Per layer `(NB, H, BS, 2D)` views of one random buffer laid out in vLLM's stride order
    `order` (`KVCacheLayout`: "LBHNC" is the CPU backend's, "LBNHC" FlashAttention's default,
    "BLNHC" etc. cross-layer), as vLLM's `create_kv_cache_views` builds them."""
    physical = torch.randn([SIZES[axis] for axis in order]).to(dtype)
    return list(physical.permute([order.index(axis) for axis in "LBHNC"]).unbind(0))


def read(kind: str, kv: torch.Tensor, slot: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) `(D,)` of one slot and head of one layer, by the layout's formula."""
    b, off = divmod(slot, BS)
    if kind == "cpu":
        page = kv[b, head].reshape(-1)  # a view: pages are contiguous
        return page[:D * BS].view(D, BS)[:, off], page[D * BS:].view(BS, D)[off]
    return kv[b, head, off, :D], kv[b, head, off, D:]


def write(kind: str, kv: torch.Tensor, slot: int, head: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Writes K and V `(D,)` of one slot and head of one layer in place, by the formula."""
    k_view, v_view = read(kind, kv, slot, head)
    k_view.copy_(k)
    v_view.copy_(v)


# (backend, vLLM stride order): CPU only allows orders whose (N, C) page is contiguous.
CASES = [("cpu", "LBHNC"), ("cpu", "BLHNC"), ("cpu", "LHBNC"),
         ("flash", "LBNHC"), ("flash", "LBHNC"), ("flash", "BLNHC"), ("flash", "BHLNC")]
CLASSES: dict[str, type[PagedKVLayout]] = {"cpu": VllmCpuLayout, "flash": VllmFlashLayout}


@pytest.mark.parametrize(("kind", "order"), CASES)
def test_gather_reads_the_formula(kind: str, order: str) -> None:
    caches = vllm_caches(order)
    before = [kv.clone() for kv in caches]
    layout = vllm_layout_for(caches, kind)
    assert type(layout) is CLASSES[kind]
    assert (layout.num_layers, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_size) == (
        L, NB, BS, H, D)
    chunk = layout.gather_chunk(SLOTS)
    assert chunk.shape == (L, 2, len(SLOTS), H, D) and chunk.is_contiguous()
    for layer, kv in enumerate(caches):
        for i, slot in enumerate(SLOTS.tolist()):
            for head in range(H):
                k, v = read(kind, kv, slot, head)
                assert torch.equal(chunk[layer, 0, i, head], k) and torch.equal(chunk[layer, 1, i, head], v)
    per_layer = layout.gather_layers(SLOTS)
    assert torch.equal(torch.cat(per_layer), chunk)
    # Each layer its own allocation; gathers copy and leave the caches alone.
    assert len({t.untyped_storage().data_ptr() for t in per_layer}) == L and per_layer[0].is_contiguous()
    chunk.zero_()
    assert all(torch.equal(a, b) for a, b in zip(caches, before))
    assert layout.gather_chunk(torch.empty(0, dtype=torch.long)).shape == (L, 2, 0, H, D)


@pytest.mark.parametrize(("kind", "order"), CASES)
def test_scatters_write_the_formula_in_place_and_nothing_else(kind: str, order: str) -> None:
    caches = vllm_caches(order)
    expected = [kv.clone() for kv in caches]
    layout = vllm_layout_for(caches, kind)
    chunk = torch.randn(L, 2, len(SLOTS), H, D)
    layout.scatter_chunk(SLOTS, chunk)
    for layer in range(L):
        for i, slot in enumerate(SLOTS.tolist()):
            for head in range(H):
                write(kind, expected[layer], slot, head, chunk[layer, 0, i, head], chunk[layer, 1, i, head])
    # Compared through the caller's views: the writes landed in its buffer, and only there.
    assert all(torch.equal(a, b) for a, b in zip(caches, expected))
    assert torch.equal(layout.gather_chunk(SLOTS), chunk)

    one = torch.randn(2, 3, H, D, dtype=torch.float64)  # cast to the caches' dtype
    layout.scatter_layer(1, SLOTS[:3], one)
    for i, slot in enumerate(SLOTS[:3].tolist()):
        for head in range(H):
            write(kind, expected[1], slot, head, one[0, i, head].float(), one[1, i, head].float())
    assert all(torch.equal(a, b) for a, b in zip(caches, expected))


@pytest.mark.parametrize(("kind", "order"), CASES)
def test_every_slot_round_trips(kind: str, order: str) -> None:
    """All slots at once, permuted: no two (slot, head, K/V, dim) share a place."""
    layout = vllm_layout_for(vllm_caches(order, torch.bfloat16), kind)
    slots = torch.randperm(NB * BS)
    chunk = torch.randn(L, 2, NB * BS, H, D).to(torch.bfloat16)
    layout.scatter_chunk(slots, chunk)
    assert torch.equal(layout.gather_chunk(slots), chunk)
    for layer in range(L):
        layout.scatter_layer(layer, slots, -chunk[layer])
    assert torch.equal(torch.cat(layout.gather_layers(slots)), -chunk)


@pytest.mark.parametrize(("kind", "order"), [("cpu", "LBHNC"), ("flash", "LBNHC")])
def test_bad_shapes_slots_and_layers_raise_before_writing(kind: str, order: str) -> None:
    caches = vllm_caches(order)
    before = [kv.clone() for kv in caches]
    layout = vllm_layout_for(caches, kind)
    n = len(SLOTS)
    bad: list[tuple[str, Callable[[], object]]] = [
        ("does not match", lambda: layout.scatter_chunk(SLOTS, torch.zeros(L, 2, n, H, D + 1))),
        ("does not match", lambda: layout.scatter_chunk(SLOTS, torch.zeros(L - 1, 2, n, H, D))),
        ("slot range", lambda: layout.scatter_chunk(torch.tensor([0, NB * BS]), torch.zeros(L, 2, 2, H, D))),
        ("slot range", lambda: layout.scatter_layer(0, torch.tensor([-1]), torch.zeros(2, 1, H, D))),
        ("int64", lambda: layout.scatter_chunk(SLOTS.int(), torch.zeros(L, 2, n, H, D))),
        ("1-D", lambda: layout.scatter_chunk(SLOTS.view(1, -1), torch.zeros(L, 2, n, H, D))),
        ("layer 3 outside", lambda: layout.scatter_layer(L, SLOTS, torch.zeros(2, n, H, D))),
        ("layer -1 outside", lambda: layout.scatter_layer(-1, SLOTS, torch.zeros(2, n, H, D))),
        ("does not match", lambda: layout.scatter_layer(0, SLOTS, torch.zeros(1, n, H, D))),
        ("slot range", lambda: layout.gather_chunk(torch.tensor([NB * BS]))),
        ("slot range", lambda: layout.gather_layers(torch.tensor([-3]))),
    ]
    for message, call in bad:
        with pytest.raises(ValueError, match=message):
            call()
    assert all(torch.equal(a, b) for a, b in zip(caches, before))


def test_backends_and_shapes_that_do_not_fit_are_named() -> None:
    with pytest.raises(ValueError, match="unknown vLLM KV layout 'rocm'.*cpu, flash, engine"):
        vllm_layout_for(vllm_caches("LBHNC"), "rocm")
    with pytest.raises(ValueError, match=r"VllmCpuLayout: .*2 \* head_size\), got \(2, 6, 8, 2, 4\)"):
        vllm_layout_for([torch.zeros(2, NB, BS, H, D)], "cpu")
    with pytest.raises(ValueError, match=r"VllmFlashLayout: .*got \(6, 2, 8, 7\)"):
        vllm_layout_for([torch.zeros(NB, H, BS, 7)], "flash")
    with pytest.raises(ValueError, match="no decoder for vLLM's 'neon' CPU pages; known: vec, vec16, amx"):
        vllm_layout_for(vllm_caches("LBHNC"), "cpu", decoder="neon")
    with pytest.raises(ValueError, match="VllmAmxLayout reads 2-byte K/V with block_size a multiple of 32"):
        vllm_layout_for(vllm_caches("LBHNC", torch.bfloat16), "cpu", decoder="amx")  # block size 8
    with pytest.raises(ValueError, match="page contiguous"):
        vllm_layout_for(vllm_caches("LBNHC"), "cpu")  # FlashAttention's token-major order
    with pytest.raises(ValueError, match="differs"):
        vllm_layout_for([torch.zeros(NB, H, BS, 2 * D), torch.zeros(NB + 1, H, BS, 2 * D)], "flash")
    with pytest.raises(ValueError, match="empty"):
        vllm_layout_for([], "flash")
    with pytest.raises(ValueError, match=r"\(2, num_blocks, block_size, num_kv_heads, head_size\)"):
        vllm_layout_for(vllm_caches("LBHNC"), "engine")


def test_engine_backend_is_the_engine_layout() -> None:
    caches = [torch.randn(2, NB, BS, H, D) for _ in range(L)]
    layout = vllm_layout_for(caches, "engine")
    assert type(layout) is EngineLayout
    chunk = layout.gather_chunk(SLOTS)
    b, off = divmod(int(SLOTS[2]), BS)
    assert torch.equal(chunk[1, :, 2], caches[1][:, b, off])


@pytest.mark.parametrize("order", ["LBHNC", "BLHNC", "LHBNC"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cpu_kernel_moves_exactly_what_the_views_move(order: str, dtype: torch.dtype) -> None:
    """VllmCpuLayout's compiled copies (engine/csrc/kv_pages.cpp; the formula tests above run
    them) against its PyTorch path through the K^T views, on the same caches."""
    torch.manual_seed(0)
    fast = VllmCpuLayout(vllm_caches(order, dtype))
    torch.manual_seed(0)
    slow = VllmCpuLayout(vllm_caches(order, dtype), kernels=False)
    assert fast._ops is not None, "engine/csrc did not build (needs g++)"
    slots = torch.randperm(NB * BS)[:29]
    assert torch.equal(fast.gather_chunk(slots), slow.gather_chunk(slots))
    assert all(torch.equal(a, b) for a, b in zip(fast.gather_layers(slots), slow.gather_layers(slots)))
    chunk = torch.randn(L, 2, len(slots), H, D).to(dtype)
    fast.scatter_chunk(slots, chunk)
    slow.scatter_chunk(slots, chunk)
    fast.scatter_layer(2, slots[:5], -chunk[2, :, :5])
    slow.scatter_layer(2, slots[:5], -chunk[2, :, :5])
    assert all(torch.equal(a, b) for a, b in zip(fast.kv_caches, slow.kv_caches))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_tiles_match_the_views(dtype: torch.dtype) -> None:
    """The compiled copies' 16 x 16 register tiles of K^T (4-byte elements; other sizes go
    element by element) at a real geometry: whole blocks, runs starting inside a block with a
    tile and a remainder, single tokens, head sizes with and without a partial tile."""
    for layers, nb, h, bs, d in [(2, 6, 3, 32, 64), (1, 5, 2, 48, 40)]:
        torch.manual_seed(1)
        physical = torch.randn(layers, nb, h, bs, 2 * d).to(dtype)
        fast, slow = VllmCpuLayout(list(physical.clone())), VllmCpuLayout(list(physical.clone()), kernels=False)
        assert fast._ops is not None, "engine/csrc did not build (needs g++)"
        runs = [torch.arange(0, bs), torch.arange(2 * bs + 5, 2 * bs + 5 + 27), torch.tensor([bs + 3, 4 * bs + 1]),
                torch.arange(3 * bs + 16, 4 * bs)]
        slots = torch.cat(runs)
        assert torch.equal(fast.gather_chunk(slots), slow.gather_chunk(slots))
        chunk = torch.randn(layers, 2, len(slots), h, d).to(dtype)
        fast.scatter_chunk(slots, chunk)
        slow.scatter_chunk(slots, chunk)
        assert all(torch.equal(a, b) for a, b in zip(fast.kv_caches, slow.kv_caches))
        assert torch.equal(fast.gather_chunk(slots), chunk)


@pytest.mark.parametrize(("layout", "dtype"), [
    (VllmTileLayout, torch.float32), (VllmTileLayout, torch.bfloat16), (VllmTileLayout, torch.float8_e4m3fn),
    (VllmAmxLayout, torch.bfloat16), (VllmAmxLayout, torch.float16)])
def test_the_compiled_page_copies_move_what_the_views_move(layout: type[VllmTileLayout | VllmAmxLayout],
                                                           dtype: torch.dtype) -> None:
    """engine/csrc's copies for pages moved as tiles (`copy_kv_pages`, K's half as token rows)
    and for "amx" pages (`copy_amx_blocks`) against each layout's PyTorch path, at vLLM's CPU
    block size and the default model's head size: whole blocks in any order (and, for "amx", a
    partial block through its token path), both directions, per chunk and per layer, byte for
    byte; blocks not moved stay as they were."""
    layers, nb, h, bs, d = 2, 5, 3, 128, 64
    torch.manual_seed(3)
    physical = torch.randn(layers, nb, h, bs, 2 * d).to(dtype)
    fast = layout(list(physical.clone()))
    slow = layout(list(physical.clone()), kernels=False)
    assert fast._ops is not None, "engine/csrc did not build (needs g++)"
    runs = [torch.arange(b * bs, (b + 1) * bs) for b in (3, 0)]
    if layout is VllmAmxLayout:
        runs.append(torch.arange(bs + 7, bs + 40))
    slots = torch.cat(runs)

    def same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
        return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True))

    assert same([fast.gather_chunk(slots)], [slow.gather_chunk(slots)])
    chunk = torch.randn(layers, 2, len(slots), h, d).to(dtype)
    fast.scatter_chunk(slots, chunk)
    slow.scatter_chunk(slots, chunk)
    fast.scatter_layer(1, slots[:bs], chunk[0, :, :bs])
    slow.scatter_layer(1, slots[:bs], chunk[0, :, :bs])
    assert same(fast.kv_caches, slow.kv_caches)
    assert same(fast.gather_layers(slots), slow.gather_layers(slots))
    assert same([kv[[2, 4]] for kv in fast.kv_caches], [p[[2, 4]] for p in physical])


@pytest.mark.parametrize("kind", ["cpu", "flash"])
def test_kv_cache_groups_move_each_layer_at_its_groups_blocks_and_skip_null_blocks(kind: str) -> None:
    """A hybrid model's layers (vLLM's hybrid KV cache manager): layers 0 and 2 in group 0
    (sliding window: null block 0 before the window), layer 1 in group 1 (full attention)."""
    caches = vllm_caches("LBHNC")
    layout = vllm_layout_for(caches, kind, layer_groups=[0, 1, 0])
    tables = [[0, 3, 4], [5, 1, 2]]  # positions 0-7 of group 0 are outside its window
    slots = layout.group_slots(tables, 2, 20)
    assert slots.shape == (2, 18) and (slots[0, :6] == -1).all() and (slots[0, 6:] >= 0).all()
    chunk = torch.randn(L, 2, 18, H, D)
    before = [kv.clone() for kv in caches]
    layout.scatter_chunk(slots, chunk)
    for layer, table in [(0, tables[0]), (1, tables[1]), (2, tables[0])]:
        for i, p in enumerate(range(2, 20)):
            block = table[p // BS]
            for h in range(H):
                k, v = read(kind, caches[layer], block * BS + p % BS, h)
                if block == 0:  # the null block is never written
                    assert torch.equal(k, read(kind, before[layer], p % BS, h)[0])
                else:
                    assert torch.equal(k, chunk[layer, 0, i, h]) and torch.equal(v, chunk[layer, 1, i, h])
    held = layout.group_slots(tables, 8, 20)  # every group holds these: they gather back
    assert torch.equal(layout.gather_chunk(held), chunk[:, :, 6:])
    with pytest.raises(ValueError, match="holds no block"):
        layout.gather_chunk(slots)
    with pytest.raises(ValueError, match="one row per KV cache group"):
        layout.scatter_chunk(slots[:1], chunk)


def test_one_kv_cache_group_of_sliding_window_layers_skips_its_null_blocks() -> None:
    """A model whose every layer slides: one group, whose table still holds null blocks."""
    caches = vllm_caches("LBHNC")
    layout = vllm_layout_for(caches, "cpu", layer_groups=[0, 0, 0])
    slots = layout.group_slots([[0, 3, 4]], 2, 20)
    assert slots.shape == (1, 18) and (slots[0, :6] == -1).all()
    null_page = [kv[0].clone() for kv in caches]
    chunk = torch.randn(L, 2, 18, H, D)
    layout.scatter_chunk(slots, chunk)
    assert all(torch.equal(kv[0], page) for kv, page in zip(caches, null_page))
    assert torch.equal(layout.gather_chunk(layout.group_slots([[0, 3, 4]], 8, 20)), chunk[:, :, 6:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("start", [0, 1, 2, 32, 37])
def test_the_kernel_moves_whole_tiles_as_the_views_do(dtype: torch.dtype, start: int, ops: ModuleType) -> None:
    """vLLM's CPU pages at its block size: engine/csrc's copy (K^T in register tiles, streaming
    stores where lines are whole) writes and reads exactly what the views do, from any offset
    (`ops`: the kernels must build here, tests/fixtures/cpu_kernels.py)."""
    bs, heads, d, layers = 128, 2, 64, 2
    caches = [torch.randn(4, heads, bs, 2 * d).to(dtype) for _ in range(layers)]
    by_views = [c.clone() for c in caches]
    fast, slow = VllmCpuLayout(caches), VllmCpuLayout(by_views, kernels=False)
    assert fast._ops is ops  # the layout moves tiles with the kernels, not its views
    slots = torch.cat([torch.arange(bs + start, 3 * bs), torch.arange(start, start + 70)])  # runs of 70-256 tokens
    chunk = torch.randn(layers, 2, len(slots), heads, d).to(dtype)
    fast.scatter_chunk(slots, chunk)
    slow.scatter_chunk(slots, chunk)
    assert all(torch.equal(a, b) for a, b in zip(caches, by_views))
    assert torch.equal(fast.gather_chunk(slots), chunk) and torch.equal(slow.gather_chunk(slots), chunk)


@pytest.mark.parametrize("kind", ["vec", "tiles", "vec views", "engine"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunk_scattered_head_by_head_writes_what_the_joined_chunk_writes(kind: str, dtype: torch.dtype) -> None:
    """vLLM's chunks are stored a KV head per value: `scatter_heads` copies each piece into its
    heads' pages (the compiled layouts, without joining them) or joins them first (the rest),
    and either way writes what `scatter_chunk` of the joined chunk writes, byte for byte; pieces
    that do not make the chunk are refused before anything is written."""
    layers, nb, h, bs, d = 2, 5, 3, 32, 64
    torch.manual_seed(4)
    physical = torch.randn(layers, nb, h, bs, 2 * d).to(dtype)

    def make() -> PagedKVLayout:
        caches = list(physical.clone())
        if kind == "engine":
            return EngineLayout([c.view(2, nb, bs, h, d) for c in caches])
        if kind == "vec views":
            return VllmCpuLayout(caches, kernels=False)
        return VllmCpuLayout(caches) if kind == "vec" else VllmTileLayout(caches)

    by_heads, joined = make(), make()
    if kind in ("vec", "tiles"):
        assert by_heads._ops is not None, "engine/csrc did not build (needs g++)"  # type: ignore[attr-defined]
    tail = torch.arange(bs, 2 * bs) if kind == "tiles" else torch.arange(bs + 5, bs + 20)  # tiles: whole blocks
    slots = torch.cat([torch.arange(3 * bs, 4 * bs), tail])
    chunk = torch.randn(layers, 2, len(slots), h, d).to(dtype)
    pieces = [chunk[:, :, :, i:i + 1].contiguous() for i in range(h)]
    by_heads.scatter_heads(slots, pieces)
    joined.scatter_chunk(slots, chunk)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(by_heads.kv_caches, joined.kv_caches, strict=True))
    assert torch.equal(by_heads.gather_chunk(slots), chunk)
    before = [kv.clone() for kv in by_heads.kv_caches]
    for bad in (pieces[:2], [p[:, :, :-1] for p in pieces], [pieces[0], torch.cat(pieces[1:], dim=3)[..., :-1]]):
        with pytest.raises(ValueError):
            by_heads.scatter_heads(slots, [-p for p in bad])
    assert all(torch.equal(a, b) for a, b in zip(by_heads.kv_caches, before, strict=True))
