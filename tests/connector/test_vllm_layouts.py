"""vLLM's paged layouts behind PagedKVLayout (connector/vllm_layouts.py), on CPU tensors of
each backend's shape, against a direct per-position oracle."""

from __future__ import annotations

import pytest
import torch

from connector.vllm_layouts import VllmCpuLayout, VllmFlashLayout, vllm_layout_for
from engine.kv_cache import EngineLayout

L, NB, H, BS, D = 3, 6, 2, 8, 4


def cpu_caches() -> list[torch.Tensor]:
    """Per layer `(NB, H, BS, 2D)` views of one buffer, as vLLM's CPU backend allocates them."""
    return list(torch.randn(L, NB, H, BS, 2 * D).unbind(0))


def flash_caches() -> list[torch.Tensor]:
    """Per layer `(NB, H, BS, 2D)` strided views of a token-major `(NB, BS, H, 2D)` buffer."""
    return [t.permute(0, 2, 1, 3) for t in torch.randn(L, NB, BS, H, 2 * D).unbind(0)]


def oracle(kind: str, kv: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) `(H, D)` of one slot of one layer, read position by position."""
    b, o = divmod(slot, BS)
    if kind == "cpu":
        pages = kv.reshape(NB, H, 2 * BS * D)
        k = torch.stack([pages[b, h, :D * BS].view(D, BS)[:, o] for h in range(H)])
        v = torch.stack([pages[b, h, D * BS:].view(BS, D)[o] for h in range(H)])
        return k, v
    return kv[b, :, o, :D], kv[b, :, o, D:]


MAKERS = {"cpu": (cpu_caches, VllmCpuLayout), "flash": (flash_caches, VllmFlashLayout)}
SLOTS = torch.tensor([0, 5, 9, 17, 40, 47], dtype=torch.long)


@pytest.mark.parametrize("kind", MAKERS)
def test_gather_equals_the_oracle_and_gather_layers(kind: str) -> None:
    make, cls = MAKERS[kind]
    caches = make()
    layout = vllm_layout_for(caches, kind)
    assert isinstance(layout, cls)
    assert (layout.num_layers, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_size) == (
        L, NB, BS, H, D)
    chunk = layout.gather_chunk(SLOTS)
    assert chunk.shape == (L, 2, len(SLOTS), H, D)
    for layer, kv in enumerate(caches):
        for i, slot in enumerate(SLOTS.tolist()):
            k, v = oracle(kind, kv, slot)
            assert torch.equal(chunk[layer, 0, i], k) and torch.equal(chunk[layer, 1, i], v)
    assert torch.equal(torch.cat(layout.gather_layers(SLOTS)), chunk)


@pytest.mark.parametrize("kind", MAKERS)
def test_scatter_writes_only_the_given_slots_in_place(kind: str) -> None:
    make, _ = MAKERS[kind]
    caches = make()
    before = [kv.clone() for kv in caches]
    layout = vllm_layout_for(caches, kind)
    chunk = torch.randn(L, 2, len(SLOTS), H, D)
    layout.scatter_chunk(SLOTS, chunk)
    assert torch.equal(layout.gather_chunk(SLOTS), chunk)
    rest = torch.tensor([s for s in range(NB * BS) if s not in SLOTS.tolist()])
    assert torch.equal(layout.gather_chunk(rest), vllm_layout_for(before, kind).gather_chunk(rest))
    one = torch.randn(2, len(SLOTS), H, D)
    layout.scatter_layer(1, SLOTS, one)
    assert torch.equal(layout.gather_layers(SLOTS)[1][0], one)
    assert torch.equal(layout.gather_layers(SLOTS)[0][0], chunk[0])


@pytest.mark.parametrize("kind", MAKERS)
def test_bad_shapes_and_slots_raise_before_writing(kind: str) -> None:
    make, _ = MAKERS[kind]
    caches = make()
    layout = vllm_layout_for(caches, kind)
    before = [kv.clone() for kv in caches]
    with pytest.raises(ValueError, match="does not match"):
        layout.scatter_chunk(SLOTS, torch.zeros(L, 2, len(SLOTS), H, D + 1))
    with pytest.raises(ValueError, match="slot range"):
        layout.scatter_chunk(torch.tensor([NB * BS]), torch.zeros(L, 2, 1, H, D))
    with pytest.raises(ValueError, match="layer 9"):
        layout.scatter_layer(9, SLOTS, torch.zeros(2, len(SLOTS), H, D))
    assert all(torch.equal(a, b) for a, b in zip(caches, before))


def test_unknown_backends_and_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="unknown vLLM KV layout 'rocm'"):
        vllm_layout_for(cpu_caches(), "rocm")
    with pytest.raises(ValueError, match=r"2 \* head_size"):
        vllm_layout_for([torch.zeros(2, NB, BS, H, D)], "cpu")
    with pytest.raises(ValueError, match="contiguous"):
        VllmCpuLayout(flash_caches())
    engine = [torch.randn(2, NB, BS, H, D) for _ in range(L)]
    assert isinstance(vllm_layout_for(engine, "engine"), EngineLayout)
