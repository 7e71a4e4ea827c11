"""CacheBlend building blocks on the real default model, with transformers as the oracle:
standalone segment K/V, RoPE re-rotation, segment keys, the blend config."""

from __future__ import annotations

import pytest
import torch

from connector.blend.blend_config import BlendConfig
from connector.blend.executor import compute_segment_kv, rerotate_kv
from connector.blend.segments import context_segments
from harness.text import long_text
from kvkeys.keyspace import ROOT_HASH, SEGMENT_ROOTS, Keyspace

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from engine.model_loader import load_tokenizer

    return load_tokenizer(default_model_path)


def hf_kv(hf_model, ids: list[int], start: int = 0) -> torch.Tensor:
    """transformers' K (after RoPE) and V `(L, 2, T, H, D)` for `ids` at positions start.."""
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), position_ids=torch.arange(start, start + len(ids))[None],
                       use_cache=True)
    layers = out.past_key_values.layers
    return torch.stack(
        [torch.stack([layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)]) for layer in layers]
    )


def test_segment_kv_matches_transformers(default_model, hf_default_model, tokenizer):
    model, _ = default_model
    ids = tokenizer.encode(long_text(2))
    torch.testing.assert_close(compute_segment_kv(model, ids), hf_kv(hf_default_model, ids), atol=1e-4, rtol=1e-4)


def test_rerotated_key_equals_fresh_key_at_new_position(default_model, hf_default_model, tokenizer):
    model, _ = default_model
    prefix = tokenizer.encode("A short system prompt that comes first.\n")
    seg = tokenizer.encode(long_text(1))
    cached = compute_segment_kv(model, seg)  # standalone: positions 0..
    moved = rerotate_kv(cached, len(prefix), model.model.rotary.inv_freq)
    # Layer 0's key depends only on the token and its position: a full prefill of
    # prefix + segment (transformers) must hold exactly the re-rotated key.
    fresh = hf_kv(hf_default_model, prefix + seg)[:, :, len(prefix):]
    assert (moved[0, 0] - fresh[0, 0]).abs().max().item() <= 1e-4
    assert not torch.allclose(cached[0, 0], fresh[0, 0], atol=1e-2)  # the shift mattered
    # Attention under RoPE sees relative positions only, so the whole segment computed at the
    # new offset has the re-rotated keys in every layer; values are untouched.
    shifted = compute_segment_kv(model, seg, start_position=len(prefix))
    torch.testing.assert_close(moved, shifted, atol=5e-4, rtol=1e-4)
    assert torch.equal(moved[:, 1], cached[:, 1])


def test_segment_keys_are_position_independent_and_never_prefix_keys():
    seg = list(range(100, 170))
    ks = Keyspace("m", "float32", 32, num_layers=2)
    a = ks.segment_spans(seg, "in_context")
    assert [(sp.start, sp.end) for sp in a] == [(0, 32), (32, 64), (64, 70)]
    assert a == ks.segment_spans(seg, "in_context")
    prefix_keys = {sp.key for sp in ks.spans(seg)}
    standalone = ks.segment_spans(seg, "standalone")
    assert not prefix_keys & {sp.key for sp in a + standalone}
    assert not {sp.key for sp in a} & {sp.key for sp in standalone}  # the two kinds never mix
    assert len({ROOT_HASH, *SEGMENT_ROOTS.values()}) == 3
    other = Keyspace("other-model", "float32", 32, num_layers=2)
    assert other.segment_spans(seg, "in_context")[0].key != a[0].key


def test_context_segments_leave_out_the_query():
    segs = context_segments([5, 7, 3])
    assert [(s.index, s.start, s.end) for s in segs] == [(0, 0, 5), (1, 5, 12)]
    with pytest.raises(ValueError, match="segment 1"):
        context_segments([5, 0, 3])


@pytest.mark.parametrize("bad, key", [
    (dict(ratio=1.5), "blend.ratio"),
    (dict(ratio="0.1"), "blend.ratio"),
    (dict(check_layer=-1), "blend.check_layer"),
    (dict(separator=""), "blend.separator"),
    (dict(narrowing=[[0, 0.1]]), r"blend.narrowing\[0\]"),
    (dict(narrowing=[[5, 0.5]]), r"blend.narrowing\[0\]"),
    (dict(narrowing=[[5, 0.1], [4, 0.05]]), r"blend.narrowing\[1\]"),
    (dict(segment_kv="prefix"), "blend.segment_kv"),
    (dict(colour="red"), "blend: unknown key"),
])
def test_blend_config_errors_name_the_key(bad, key):
    with pytest.raises(ValueError, match=key):
        BlendConfig.from_dict(bad)


def test_blend_config_check_layer_must_exist_in_model():
    assert BlendConfig.from_dict({"ratio": 0.3, "narrowing": [[8, 0.1]]}).narrowing == [(8, 0.1)]
    assert BlendConfig.from_dict(True).enabled
    assert BlendConfig.from_dict({"segment_kv": "standalone"}).segment_kv == "standalone"
    assert BlendConfig().segment_kv == "in_context"
    with pytest.raises(ValueError, match="blend.check_layer"):
        BlendConfig(check_layer=30).validate(num_layers=30)


def test_blend_recompute_in_a_paged_cache(default_model, tokenizer):
    """ratio 1 turns standalone segment K/V into exactly the full prefill's K/V; a narrowed
    selection rewrites only its tokens; positions before `start` (exact) are never touched;
    missing positions are always recomputed."""
    from connector.blend.executor import blend_recompute
    from engine.kv_cache import layout_for, request_slots

    model, mc = default_model
    segs = [tokenizer.encode("Short system prompt for the test.\n"),
            tokenizer.encode(long_text(1)), tokenizer.encode(long_text(2)[-120:])]
    ids = [t for s in segs for t in s]
    n, bs, start = len(ids), 16, 16
    nb = -(-n // bs)
    block_ids = list(reversed(range(nb)))  # a non-trivial block table
    inv_freq = model.model.rotary.inv_freq
    full = compute_segment_kv(model, ids)  # what a full prefill writes
    offsets = [0, len(segs[0]), len(segs[0]) + len(segs[1])]
    cached = torch.cat([rerotate_kv(compute_segment_kv(model, s), o, inv_freq) for s, o in zip(segs, offsets)], dim=2)
    cached[:, :, :start] = full[:, :, :start]  # the engine's exact prefix-cache hit
    slots = request_slots(block_ids, bs, 0, n)

    def fresh_caches() -> list[torch.Tensor]:
        caches = [torch.zeros(2, nb, bs, mc.num_kv_heads, mc.head_size) for _ in range(mc.num_layers)]
        layout_for(caches).scatter_chunk(slots, cached)
        return caches

    caches = fresh_caches()
    assert blend_recompute(model, caches, block_ids, bs, ids[start:], start, n, ratio=1.0) == n - start
    torch.testing.assert_close(layout_for(caches).gather_chunk(slots), full, atol=1e-4, rtol=1e-4)

    caches = fresh_caches()
    kept = blend_recompute(model, caches, block_ids, bs, ids[start:], start, n, ratio=0.3, narrowing=[(6, 0.1)])
    assert kept == -(-(n - start) // 10)
    got = layout_for(caches).gather_chunk(slots)
    assert torch.equal(got[:, :, :start], cached[:, :, :start])
    torch.testing.assert_close(got[0], full[0], atol=1e-4, rtol=1e-4)  # below the check layer: all fresh
    # At the check layer every token's fresh K/V was computed to select from, so all of it is kept.
    torch.testing.assert_close(got[1], full[1], atol=1e-4, rtol=1e-4)
    changed = (got != cached).any(-1).any(-1).any(1)  # [layers, tokens]
    assert 0 < int(changed[3].sum()) <= -(-(n - start) * 3 // 10)
    assert 0 < int(changed[10].sum()) <= kept
    before = layout_for(caches).gather_chunk(slots)
    assert blend_recompute(model, caches, block_ids, bs, ids[start:], start, n, ratio=0.0) == 0
    assert torch.equal(layout_for(caches).gather_chunk(slots), before)  # ratio 0: the cache is left as is

    # A segment with nothing stored (NaN in its slots: never read) is recomputed through every
    # layer inside the prompt; after the exact prefix that is the full prefill's K/V.
    a, b = start, len(segs[0]) + len(segs[1])  # segment 1, past the engine's hit
    caches = fresh_caches()
    for c in caches:
        c.view(2, -1, *c.shape[-2:])[:, slots[a:b]] = float("nan")
    missing = torch.zeros(n - start, dtype=torch.bool)
    missing[a - start:b - start] = True
    assert blend_recompute(model, caches, block_ids, bs, ids[start:], start, n, ratio=0.0, missing=missing) == b - a
    got = layout_for(caches).gather_chunk(slots)
    assert not got.isnan().any()
    torch.testing.assert_close(got[:, :, a:b], full[:, :, a:b], atol=1e-4, rtol=1e-4)
    assert torch.equal(got[2:, :, b:], cached[2:, :, b:])  # past the check layer, reused as is
    with pytest.raises(ValueError, match="missing has shape"):
        blend_recompute(model, caches, block_ids, bs, ids[start:], start, n, ratio=0.1, missing=missing[1:])


def test_blend_from_connector_config_and_cli_flags():
    import argparse

    from connector.blend.blend_planner import BlendPlanner
    from connector.cli_flags import add_connector_arguments, connector_from_args
    from connector.connector_config import ConnectorConfig
    from connector.engine_connector import EngineConnector, build_connector
    from connector.extension import NoPlannerExtension

    cfg = ConnectorConfig.from_dict({"tiers": ["cpu"], "blend": {"enabled": True, "ratio": 0.3}})
    conn = build_connector(cfg)
    try:
        assert isinstance(conn.planner.extension, BlendPlanner) and conn.planner.extension.config.ratio == 0.3
        assert conn.planner.segment_separator == " # # "
    finally:
        conn.shutdown()
    plain = build_connector("cpu")
    try:
        assert type(plain) is EngineConnector and isinstance(plain.planner.extension, NoPlannerExtension)
        assert plain.planner.segment_separator is None
    finally:
        plain.shutdown()
    with pytest.raises(ValueError, match="blend.check_layer"):
        ConnectorConfig.from_dict({"blend": {"check_layer": "one"}})

    ap = argparse.ArgumentParser()
    add_connector_arguments(ap)
    conn = connector_from_args(ap.parse_args(["--blend", "--blend-ratio", "0.05", "--blend-check-layer", "2"]))
    try:
        assert (conn.config.extensions["blend"].ratio, conn.config.extensions["blend"].check_layer) == (0.05, 2)
        ext = conn.planner.extension
        assert isinstance(ext, BlendPlanner) and ext.config is conn.config.extensions["blend"]
    finally:
        conn.shutdown()
    with pytest.raises(ValueError, match="--blend-ratio"):
        connector_from_args(ap.parse_args(["--blend-ratio", "0.2"]))
    with pytest.raises(ValueError, match="blend.ratio"):
        connector_from_args(ap.parse_args(["--blend", "--blend-ratio", "1.5"]))
