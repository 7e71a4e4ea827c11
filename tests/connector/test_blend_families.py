"""CacheBlend on every model family (tests/fixtures/families.py's tiny random checkpoints),
through each family's own layer code: a standalone segment's K/V equals the engine's own
prefill (itself proven against transformers), re-rotation with each layer's frequencies
moves it exactly, ratio 1 restores a full prefill in the paged cache and end to end, and
the features CacheBlend must honour (soft-caps, sliding windows, per-layer RoPE) each make
the comparison fail when switched off. Longrope (Phi-3) is refused by name."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from connector.blend.executor import blend_recompute, check_blendable, compute_segment_kv, layer_inv_freqs, rerotate_kv
from connector.engine_connector import build_connector
from engine import SamplingParams
from engine.kv_cache import layout_for, request_slots
from engine.model_loader import load_model
from harness.families import FAMILIES
from harness.model import FAMILY_TINY, make_tiny_checkpoint
from harness.paged import PagedDriver
from tests.fixtures.connector import engine

BLENDABLE = sorted(set(FAMILIES) - {"phi3"})
SEGMENT_LENS = (40, 150, 170, 12)  # system, two documents, query: windows of 128 bite
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class Tiny:
    def __init__(self, name: str, tmp: Path, tokenizer_dir: Path) -> None:
        self.name = name
        self.ckpt = make_tiny_checkpoint(tmp, tokenizer_dir=tokenizer_dir, **{**FAMILY_TINY, **FAMILIES[name]})
        self.model, self.cfg = load_model(self.ckpt, torch.device("cpu"), torch.float32)
        rng = random.Random(len(name))
        self.segments = [rng.choices(range(3, FAMILY_TINY["vocab_size"]), k=n) for n in SEGMENT_LENS]
        self.ids = [t for s in self.segments for t in s]

    def prefill_kv(self, ids: list[int]) -> torch.Tensor:
        """The K/V `(L, 2, T, H, D)` the engine's own forward writes for `ids`."""
        driver = PagedDriver(self.model)
        driver.step([(0, ids)])
        slots = request_slots(driver.tables[0], driver.block_size, 0, len(ids))
        return layout_for(driver.kv_caches).gather_chunk(slots)


@pytest.fixture(scope="module", params=BLENDABLE)
def tiny(request, tmp_path_factory, default_model_path: Path) -> Tiny:
    return Tiny(request.param, tmp_path_factory.mktemp(request.param), default_model_path)


# (family, feature CacheBlend must honour): each switched off must break the comparison.
FEATURES = [("gemma2", "softcap"), ("gemma2", "window"), ("gemma3", "window"), ("mixtral", "window")]


def _switch_off(tiny: Tiny, feature: str, monkeypatch) -> None:
    """Turns `feature` off in every layer of the loaded model (which must have it)."""
    layers = tiny.model.model.decoder_layers()
    attr = {"softcap": "logit_softcap", "window": "sliding_window"}[feature]
    assert any(getattr(layer.self_attn, attr) is not None for layer in layers), (tiny.name, feature)
    for layer in layers:
        monkeypatch.setattr(layer.self_attn, attr, None)


def test_segment_kv_equals_the_engines_prefill(tiny: Tiny) -> None:
    torch.testing.assert_close(compute_segment_kv(tiny.model, tiny.ids), tiny.prefill_kv(tiny.ids),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tiny, feature", FEATURES, indirect=["tiny"])
def test_segment_kv_fails_without_the_feature(tiny: Tiny, feature: str, monkeypatch) -> None:
    want = tiny.prefill_kv(tiny.ids)
    _switch_off(tiny, feature, monkeypatch)
    assert (compute_segment_kv(tiny.model, tiny.ids) - want).abs().max() > 1e-3


def test_rerotated_segment_equals_the_segment_at_its_offset(tiny: Tiny) -> None:
    seg, offset = tiny.segments[2], 190
    moved = rerotate_kv(compute_segment_kv(tiny.model, seg), offset, layer_inv_freqs(tiny.model))
    shifted = compute_segment_kv(tiny.model, seg, start_position=offset)
    torch.testing.assert_close(moved, shifted, atol=1e-4, rtol=1e-4)
    freqs = layer_inv_freqs(tiny.model)
    if any(not torch.equal(f, freqs[0]) for f in freqs):  # per-layer RoPE (Gemma 3): one table is wrong
        wrong = rerotate_kv(compute_segment_kv(tiny.model, seg), offset, freqs[0])
        assert (wrong - shifted).abs().max() > 1e-2


def _blend_in_paged_cache(tiny: Tiny, ratio: float, exact: int = 16) -> torch.Tensor:
    """Returns the paged cache's K/V after blending the standalone, re-rotated segments of
    `tiny.ids` past an exact prefix of `exact` tokens at `ratio`."""
    model, cfg, ids = tiny.model, tiny.cfg, tiny.ids
    n, bs = len(ids), 16
    nb = -(-n // bs)
    block_ids = list(reversed(range(nb)))
    offsets = [sum(SEGMENT_LENS[:i]) for i in range(len(SEGMENT_LENS))]
    cached = torch.cat([rerotate_kv(compute_segment_kv(model, s), o, layer_inv_freqs(model))
                        for s, o in zip(tiny.segments, offsets)], dim=2)
    cached[:, :, :exact] = tiny.prefill_kv(ids[:exact])
    slots = request_slots(block_ids, bs, 0, n)
    caches = [torch.zeros(2, nb, bs, cfg.num_kv_heads, cfg.head_size) for _ in range(cfg.num_layers)]
    layout_for(caches).scatter_chunk(slots, cached)
    blend_recompute(model, caches, block_ids, bs, ids[exact:], exact, n, ratio=ratio)
    return layout_for(caches).gather_chunk(slots)


def test_blend_at_ratio_one_is_a_full_prefill(tiny: Tiny) -> None:
    full = tiny.prefill_kv(tiny.ids)
    torch.testing.assert_close(_blend_in_paged_cache(tiny, 1.0), full, atol=1e-4, rtol=1e-4)
    # Plain reuse differs past layer 0 (cross-segment attention is missing): the test can tell.
    assert (_blend_in_paged_cache(tiny, 0.0)[1:] - full[1:]).abs().max() > 1e-3


@pytest.mark.parametrize("tiny, feature", FEATURES, indirect=["tiny"])
def test_blend_fails_without_the_feature(tiny: Tiny, feature: str, monkeypatch) -> None:
    full = tiny.prefill_kv(tiny.ids)
    _switch_off(tiny, feature, monkeypatch)
    assert (_blend_in_paged_cache(tiny, 1.0) - full).abs().max() > 1e-3


@pytest.fixture(scope="module")
def reference_tokens(tiny: Tiny) -> Iterator[list[list[int]]]:
    with engine(tiny.ckpt, None, enable_prefix_caching=False, num_gpu_blocks=96) as llm:
        yield [list(o.outputs[0].token_ids) for o in llm.generate(_prompts(tiny), GREEDY)]


def _prompts(tiny: Tiny) -> list[dict[str, Any]]:
    """The segments in order, then the documents swapped (a reuse that is not a prefix)."""
    sys_, a, b, q = tiny.segments
    return [{"prompt_token_ids": sys_ + a + b + q, "segment_lens": [len(sys_), len(a), len(b), len(q)]},
            {"prompt_token_ids": sys_ + b + a + q, "segment_lens": [len(sys_), len(b), len(a), len(q)]}]


def test_blend_end_to_end_at_ratio_one_gives_the_full_prefills_tokens(tiny: Tiny, reference_tokens) -> None:
    conn = build_connector({"tiers": ["cpu"], "chunk_size": 32, "blend": {"enabled": True, "ratio": 1.0}})
    with engine(tiny.ckpt, conn, num_gpu_blocks=96) as llm:
        prompts = _prompts(tiny)
        assert list(llm.generate(prompts[0], GREEDY)[0].outputs[0].token_ids) == reference_tokens[0]
        assert conn.flush(timeout=60)
        out = llm.generate(prompts[1], GREEDY)[0]  # both documents come from the cpu tier
        assert conn.request_metrics(out.request_id).connector_hit_tokens >= SEGMENT_LENS[1] + SEGMENT_LENS[2]
        assert list(out.outputs[0].token_ids) == reference_tokens[1]


def test_longrope_is_refused_by_name(tmp_path: Path, default_model_path: Path) -> None:
    ckpt = make_tiny_checkpoint(tmp_path, tokenizer_dir=default_model_path, **{**FAMILY_TINY, **FAMILIES["phi3"]})
    model, _ = load_model(ckpt, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="longrope"):
        check_blendable(model)
    with pytest.raises(TypeError, match="engine's own model"):
        check_blendable(torch.nn.Linear(2, 2))
