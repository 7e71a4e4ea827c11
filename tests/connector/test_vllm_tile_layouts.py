"""vLLM's CPU pages beyond the "vec" kernels (connector/vllm/layouts.py): the "amx" kernels'
pages decoded to the canonical form, against an oracle that reads one (slot, head) at a time
by the formula of vLLM's csrc/cpu/cpu_attn_amx.hpp, and any kernels' pages moved as whole
(block, KV head) tiles. (tests/vllm/test_cpu_layout_kernel.py checks both against vLLM's own
cache-writing op.) Also which pages move as tiles, and how their chunks are keyed."""

from __future__ import annotations

import pytest
import torch

from connector.connector_config import ConnectorConfig
from connector.vllm.layouts import VllmAmxLayout, VllmTileLayout, cpu_page_decoder, vllm_layout_for
from connector.vllm.setup import VllmModel, VllmSetup

L, NB, H, BS, D = 2, 6, 2, 32, 32
TABLE = [4, 1, 3]
# Two whole blocks of TABLE and a partial third one: the block path and the token path.
SLOTS = torch.tensor([TABLE[t // BS] * BS + t % BS for t in range(2 * BS + 9)])


def caches(dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """Per layer `(NB, H, BS, 2D)` views of one random buffer, as vLLM's CPU backend allocates."""
    return list(torch.randn(L, NB, H, BS, 2 * D).to(dtype).unbind(0))


def amx_read(kv: torch.Tensor, slot: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) `(D,)` of one slot and head, by the "amx" formula (views into the page)."""
    b, off = divmod(slot, BS)
    page = kv[b, head].reshape(-1)
    k = page[:BS * D].view(BS // 16, D // 2, 16, 2)[off // 16, :, off % 16, :]
    v = page[BS * D:].view(D // 16, BS // 2, 16, 2)[:, off // 2, :, off % 2]
    return k, v


def amx_layout(cs: list[torch.Tensor], kernels: bool) -> VllmAmxLayout:
    """The "amx" layout over `cs`, its whole blocks moved by engine/csrc's copy or the views."""
    layout = vllm_layout_for(cs, "cpu", decoder="amx") if kernels else VllmAmxLayout(cs, kernels=False)
    assert type(layout) is VllmAmxLayout and (layout._ops is not None) == kernels, "engine/csrc did not build"
    return layout


@pytest.mark.parametrize("kernels", [True, False])
def test_amx_gather_reads_the_formula_on_both_paths(kernels: bool) -> None:
    cs = caches()
    before = [c.clone() for c in cs]
    layout = amx_layout(cs, kernels)
    for slots in (SLOTS, SLOTS.flip(0)):  # whole blocks first, then none (token by token only)
        chunk = layout.gather_chunk(slots)
        for layer in range(L):
            for i, slot in enumerate(slots.tolist()):
                for head in range(H):
                    k, v = amx_read(cs[layer], slot, head)
                    assert torch.equal(chunk[layer, 0, i, head], k.reshape(D))
                    assert torch.equal(chunk[layer, 1, i, head], v.reshape(D))
        assert torch.equal(torch.cat(layout.gather_layers(slots)), chunk)
    assert all(torch.equal(a, b) for a, b in zip(cs, before))


@pytest.mark.parametrize("kernels", [True, False])
def test_amx_scatter_writes_the_formula_and_nothing_else(kernels: bool) -> None:
    cs = caches()
    expected = [c.clone() for c in cs]
    layout = amx_layout(cs, kernels)
    chunk = torch.randn(L, 2, len(SLOTS), H, D).to(torch.bfloat16)
    layout.scatter_chunk(SLOTS, chunk)
    for layer in range(L):
        for i, slot in enumerate(SLOTS.tolist()):
            for head in range(H):
                k, v = amx_read(expected[layer], slot, head)
                k.copy_(chunk[layer, 0, i, head].view(D // 2, 2))
                v.copy_(chunk[layer, 1, i, head].view(D // 16, 16))
    assert all(torch.equal(a, b) for a, b in zip(cs, expected))
    every = torch.randperm(NB * BS)  # all slots at once: no two elements share a place
    whole = torch.randn(L, 2, NB * BS, H, D).to(torch.bfloat16)
    layout.scatter_chunk(every, whole)
    assert torch.equal(layout.gather_chunk(every), whole)
    blocks = torch.arange(NB * BS)  # and block by block
    layout.scatter_chunk(blocks, whole)
    assert torch.equal(layout.gather_chunk(blocks), whole)


def test_tiles_move_byte_for_byte_into_other_blocks() -> None:
    src, dst = caches(), [torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
    whole = SLOTS[:2 * BS]
    chunk = vllm_layout_for(src, "cpu", decoder=None).gather_chunk(whole)
    assert chunk.shape == (L, 2, 2 * BS, H, D)
    other = torch.tensor([b * BS + o for b in (2, 5) for o in range(BS)])
    out = vllm_layout_for(dst, "cpu", decoder=None)
    assert type(out) is VllmTileLayout
    out.scatter_chunk(other, chunk)
    for layer in range(L):
        assert torch.equal(dst[layer][2], src[layer][TABLE[0]]) and torch.equal(dst[layer][5], src[layer][TABLE[1]])
        assert not dst[layer][[0, 1, 3, 4]].any()
    # Per head: a chunk of some heads holds exactly those heads' tiles.
    assert torch.equal(out.gather_chunk(other)[:, :, :, 1], chunk[:, :, :, 1])


def test_tiles_refuse_part_of_a_block_before_writing() -> None:
    cs = caches()
    before = [c.clone() for c in cs]
    layout = VllmTileLayout(cs)
    for slots in (SLOTS, SLOTS[1:BS + 1], SLOTS[:BS].flip(0)):
        with pytest.raises(ValueError, match="moves whole blocks only"):
            layout.scatter_chunk(slots, torch.zeros(L, 2, len(slots), H, D))
        with pytest.raises(ValueError, match="moves whole blocks only"):
            layout.gather_chunk(slots)
    assert all(torch.equal(a, b) for a, b in zip(cs, before))


def test_tiles_skip_a_sliding_windows_null_blocks() -> None:
    cs = caches()
    layout = VllmTileLayout(cs, layer_groups=[0, 1])
    tables = [[4, 1], [0, 2]]  # group 1 holds no block for the first BS positions (vLLM's null block 0)
    slots = layout.group_slots(tables, 0, 2 * BS)
    before = [c.clone() for c in cs]
    chunk = torch.randn(L, 2, 2 * BS, H, D).to(torch.bfloat16)
    layout.scatter_chunk(slots, chunk)
    assert torch.equal(cs[1][0], before[1][0])  # the null block is never written
    assert torch.equal(layout.gather_layers(slots[:, BS:])[1], chunk[1:, :, BS:])


def test_which_pages_move_as_tiles() -> None:
    assert [cpu_page_decoder(isa, 2) for isa in ("vec", "vec16", "amx", "neon", "rvv")] == [
        "vec", "vec16", "amx", None, None]
    assert cpu_page_decoder("amx", 1) is None  # fp8 K/V under the amx kernels: another tile format
    assert cpu_page_decoder("vec", 1) == "vec"
    assert cpu_page_decoder("vec", 2, "tiles") is None
    with pytest.raises(ValueError, match="cpu_page_form must be one of auto, tiles"):
        cpu_page_decoder("vec", 2, "decoded")


def test_tile_chunks_are_keyed_by_their_format_and_span_whole_blocks() -> None:
    def setup(isa: str | None, form: str = "auto", cache_dtype: str = "auto") -> VllmSetup:
        return VllmSetup(ConnectorConfig(chunk_size=128, cpu_page_form=form), VllmModel("m+vllm-cpu", 2, 2, 64),
                         torch.bfloat16, 32, {}, loads=True, saves=True, events=False, cache_dtype=cache_dtype,
                         isa=isa)

    labels = {(isa, form, dt): setup(isa, form, dt).keyspace().kv_dtype
              for isa, form, dt in [("vec", "auto", "auto"), ("amx", "auto", "auto"), (None, "auto", "auto"),
                                    ("vec", "tiles", "auto"), ("amx", "tiles", "auto"), ("neon", "auto", "auto"),
                                    ("amx", "auto", "fp8")]}
    assert labels == {("vec", "auto", "auto"): "bfloat16", ("amx", "auto", "auto"): "bfloat16",
                      (None, "auto", "auto"): "bfloat16", ("vec", "tiles", "auto"): "bfloat16.vec-tiles-b32",
                      ("amx", "tiles", "auto"): "bfloat16.amx-tiles-b32",
                      ("neon", "auto", "auto"): "bfloat16.neon-tiles-b32",
                      ("amx", "auto", "fp8"): "fp8_e4m3.amx-tiles-b32"}
    tiles, decoded = setup("amx", "tiles").keyspace(), setup("amx").keyspace()
    tokens = list(range(300))
    assert [(sp.start, sp.end) for sp in tiles.spans(tokens)] == [(0, 128), (128, 256), (256, 288)]
    assert [(sp.start, sp.end) for sp in decoded.spans(tokens)] == [(0, 128), (128, 256), (256, 300)]
    assert [sp.end for sp in tiles.partial_spans(tokens[256:], 256, tiles.spans(tokens)[1].chain)] == [288]
    # The chain is the same; only the format in the key differs: tiles never meet decoded chunks.
    assert tiles.spans(tokens)[0].chain == decoded.spans(tokens)[0].chain
    assert tiles.spans(tokens)[0].key != decoded.spans(tokens)[0].key
    with pytest.raises(ValueError, match="chunk_size 100 must be a multiple of the tokens of one tile"):
        VllmSetup(ConnectorConfig(chunk_size=100, cpu_page_form="tiles"), VllmModel("m+vllm-cpu", 2, 2, 64),
                  torch.bfloat16, 32, {}, loads=True, saves=True, events=False, isa="vec").keyspace()
