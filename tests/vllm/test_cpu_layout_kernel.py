"""VllmCpuLayout reads exactly what vLLM's own CPU kernel writes (`cpu_attn_reshape_and_cache`),
and what it scatters sits where that kernel would have put it."""

from __future__ import annotations

import pytest
import torch
from vllm._custom_ops import cpu_attn_reshape_and_cache
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from connector.vllm_layouts import VllmCpuLayout


@pytest.mark.parametrize(("dtype", "block_size", "head_size"), [(torch.float32, 128, 64), (torch.float32, 16, 64),
                                                                 (torch.bfloat16, 32, 128)])
def test_layout_matches_the_kernel(dtype: torch.dtype, block_size: int, head_size: int) -> None:
    torch.manual_seed(0)
    num_blocks, heads, layers = 5, 3, 2
    isa = _get_attn_isa(dtype, block_size, head_size)
    caches = list(torch.zeros(layers, num_blocks, heads, block_size, 2 * head_size, dtype=dtype).unbind(0))
    n = 2 * block_size + 5  # two full blocks and a partial one
    table = [4, 1, 3]
    slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(n)])
    kv = torch.randn(layers, 2, n, heads, head_size).to(dtype)
    for layer, cache in enumerate(caches):
        k_cache, v_cache = cache.view(num_blocks, heads, 2 * block_size, head_size).chunk(2, dim=2)
        cpu_attn_reshape_and_cache(kv[layer, 0], kv[layer, 1], k_cache, v_cache, slots, isa)
    layout = VllmCpuLayout(caches)
    assert torch.equal(layout.gather_chunk(slots), kv)
    # Scattered into zeroed caches, the same K/V gives the kernel's bytes.
    written = [c.clone() for c in caches]
    for c in caches:
        c.zero_()
    layout.scatter_chunk(slots, kv)
    assert all(torch.equal(a, b) for a, b in zip(caches, written))
