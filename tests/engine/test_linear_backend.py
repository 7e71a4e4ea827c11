"""The model's packed linear layers (engine/linear_backend.py) against `F.linear`: kvtier's
panel kernel (float32) and oneDNN's prepacked weights, how the engine picks between them, and
oneDNN's bounded GEMM caches."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.linear_backend import (
    EXACT_ROWS,
    GEMM_CACHE_CAPACITY,
    PackedLinear,
    PanelLinear,
    linear_packer,
    onednn_supported,
    pack_linears,
    padded_rows,
    to_panels,
)
from harness import process

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("out_features,in_features", [(96, 64), (40, 24), (17, 8), (1, 5), (960, 576), (1000, 4096)])
@pytest.mark.parametrize("bias", [True, False])
def test_panel_linear_equals_f_linear(ops: ModuleType, out_features: int, in_features: int, bias: bool) -> None:
    """Every row count a step has (one decode row, a micro-kernel's 6 and its remainders, all
    rows per thread up to 1024, then row blocks), output widths that fill no whole panel, a
    weight in two slices of 8 MB (1000 x 4096), with and without bias."""
    torch.manual_seed(out_features + in_features)
    linear = nn.Linear(in_features, out_features, bias=bias)
    panel = PanelLinear(linear.weight, linear.bias, ops)
    for rows in (1, 2, 5, 6, 7, 64, 97, 1024, 1025, 1500):
        x = torch.randn(rows, in_features)
        ref = F.linear(x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double())
        out = panel(x)
        assert out.shape == (rows, out_features) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-5)


def test_panel_linear_rows_do_not_depend_on_their_batch(ops: ModuleType) -> None:
    """Each row sums its products in one order whatever the rows beside it: a sequence's
    logits are the same bits alone, in a decode batch, or inside a long prefill."""
    torch.manual_seed(2)
    linear = nn.Linear(576, 200)
    panel = PanelLinear(linear.weight, linear.bias, ops)
    x = torch.randn(1100, 576)
    whole = panel(x)
    for rows in (slice(0, 1), slice(5, 6), slice(7, 14), slice(96, 200), slice(1000, 1100), slice(1099, 1100)):
        assert torch.equal(panel(x[rows]), whole[rows])


def test_panel_linear_keeps_the_input_shape_and_reads_strided_input(ops: ModuleType) -> None:
    torch.manual_seed(1)
    linear = nn.Linear(48, 80)
    panel = PanelLinear(linear.weight, linear.bias, ops)
    x = torch.randn(3, 131, 48)
    assert panel(x).shape == (3, 131, 80)
    torch.testing.assert_close(panel(x), linear(x), atol=1e-4, rtol=0)
    wide = torch.randn(7, 96)[:, ::2]  # rows with a stride: copied before the kernel
    torch.testing.assert_close(panel(wide), linear(wide), atol=1e-4, rtol=0)
    assert panel(torch.zeros(0, 48)).shape == (0, 80)


def test_panels_hold_the_weight_sixteen_outputs_at_a_time() -> None:
    weight = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    panels = to_panels(weight)
    assert panels.shape == (2, 3, 16) and panels.is_contiguous()
    assert torch.equal(panels[0], weight[:16].t()) and torch.equal(panels[1, :, :4], weight[16:].t())
    assert not panels[1, :, 4:].any()
    whole = to_panels(weight[:16].repeat(2, 1))  # 32 outputs: two full panels, no padding
    assert whole.shape == (2, 3, 16) and whole.is_contiguous() and torch.equal(whole[1], weight[:16].t())


def test_panel_linear_refuses_what_it_cannot_run(ops: ModuleType) -> None:
    with pytest.raises(ValueError, match="float32 on CPU"):
        PanelLinear(torch.zeros(16, 8, dtype=torch.bfloat16), None, ops)
    panel = PanelLinear(torch.zeros(16, 8), None, ops)
    with pytest.raises(RuntimeError, match="x has 4 features, the weight 8"):
        panel.ops.panel_linear(torch.zeros(2, 4), panel.panels, None, 16)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        panel(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="do not fill"):
        panel.ops.panel_linear(torch.zeros(2, 8), panel.panels, None, 17)
    with pytest.raises(RuntimeError, match="bias must be"):
        panel.ops.panel_linear(torch.zeros(2, 8), panel.panels, torch.zeros(15), 16)


def test_the_engine_packs_float32_in_panels_and_other_dtypes_on_onednn(ops: ModuleType) -> None:
    packer = linear_packer(CPU, torch.float32, ops)
    assert packer is not None and isinstance(packer(torch.zeros(16, 8), None), PanelLinear)
    assert linear_packer(CPU, torch.float32, None) is (PackedLinear if onednn_supported(CPU, torch.float32) else None)
    assert linear_packer(CPU, torch.bfloat16, ops) is (PackedLinear if onednn_supported(CPU, torch.bfloat16) else None)
    net = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 4, bias=False)))
    assert pack_linears(net, packer) == 2
    assert isinstance(net[0], PanelLinear) and isinstance(net[1][0], PanelLinear)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_equals_f_linear(dtype: torch.dtype) -> None:
    if not onednn_supported(CPU, dtype):
        pytest.skip(f"oneDNN cannot run {dtype} on this CPU: the engine keeps nn.Linear for it")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 96), nn.Sequential(nn.Linear(96, 32, bias=False))).to(dtype)
    x = torch.randn(7, 64, dtype=dtype)
    ref = net(x)
    weight = net[0].weight.detach().clone()
    assert pack_linears(net) == 2
    assert isinstance(net[0], PackedLinear) and isinstance(net[1][0], PackedLinear)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(net(x), ref, atol=tol, rtol=0)
    torch.testing.assert_close(net[0](x), F.linear(x, weight.to(dtype), net[0].bias), atol=tol, rtol=0)


def test_row_counts_are_bounded_with_little_padding() -> None:
    """Every step size up to 8k tokens maps to one of a few hundred oneDNN shapes, each at least
    the real row count and under 1/16 more."""
    sizes = [padded_rows(rows) for rows in range(1, 8193)]
    assert sizes[:EXACT_ROWS] == list(range(1, EXACT_ROWS + 1))
    assert all(rows <= size < rows * 17 / 16 for rows, size in enumerate(sizes, start=1))
    assert sizes == sorted(sizes) and all(padded_rows(size) == size for size in sizes)
    assert len(set(sizes)) == EXACT_ROWS + 7 * 16


@pytest.mark.skipif(not onednn_supported(CPU, torch.float32),
                    reason="this torch build has no oneDNN: PackedLinear cannot run (fp32 uses panels or nn.Linear)")
def test_packed_linear_pads_rows_and_keeps_the_input_shape() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80)
    packed = PackedLinear(linear.weight, linear.bias)
    for shape in [(EXACT_ROWS + 1, 48), (3, 131, 48), (EXACT_ROWS, 48)]:
        x = torch.randn(shape)
        out = packed(x)
        assert out.shape == (*shape[:-1], 80) and out.is_contiguous()
        torch.testing.assert_close(out, linear(x), atol=1e-5, rtol=0)


_CACHE_PROBE = """
import os, torch
from engine.linear_backend import padded_rows, pack_linears
from hostmem import resident_bytes, trim_heap
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
net = torch.nn.Sequential(*[torch.nn.Linear(i, o, bias=False) for o, i in shapes])
pack_linears(net)
def rss_mib():
    trim_heap()
    return resident_bytes() / 2**20
start = rss_mib()
for rows in sorted({padded_rows(r) for r in range(1, 2049)}):
    for linear in net:
        linear(torch.zeros(rows, linear.in_features))
print(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], os.environ["LRU_CACHE_CAPACITY"], rss_mib() - start)
"""


@pytest.mark.skipif(not onednn_supported(CPU, torch.float32),
                    reason="this torch build has no oneDNN: PackedLinear cannot run (fp32 uses panels or nn.Linear)")
def test_gemm_caches_are_bounded_in_a_fresh_process() -> None:
    """oneDNN and ideep keep memory per cached GEMM shape (~340 MiB for these 576 shapes when
    their default 1024 entries all fit): `pack_linears` caps both caches, which only works
    before the process's first oneDNN op, so the probe is a new process."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = process.run([sys.executable, "-c", _CACHE_PROBE], env={**env, "PYTHONPATH": str(REPO)},
                      capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out[:2] == [str(GEMM_CACHE_CAPACITY)] * 2
    assert float(out[2]) < 150, f"{out[2]} MiB held after 576 GEMM shapes: the caches are not capped"
