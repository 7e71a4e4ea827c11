"""Sliding-window attention (Mistral; Qwen2's sliding layers) against transformers as the oracle.

transformers lets the token at position i attend keys j with i - W < j <= i in a sliding
layer. Tiny random checkpoints with W = 8 and prompts of many windows check every attention
path: fresh prefill (one tile and several), prefill over cached context, chunked prefill,
single and batched decode, and the whole engine with chunked prefill and prefix-cache hits.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from harness.paged import PagedDriver, hf_logits, load_tiny_pair

WINDOW = 8
WINDOW_VARIANTS = {
    "mistral": dict(model_type="mistral", sliding_window=WINDOW, max_position_embeddings=2048),
    # transformers: layer i slides when i >= max_window_layers, so layer 0 is full, layer 1 slides.
    "qwen2": dict(model_type="qwen2", use_sliding_window=True, sliding_window=WINDOW,
                  max_window_layers=1, max_position_embeddings=2048),
}
DECODE = 20


@pytest.fixture(scope="module", params=sorted(WINDOW_VARIANTS))
def window_pair(request, tmp_path_factory, default_model_path: Path):
    """(our model, transformers' model, ModelConfig, checkpoint dir) of one windowed variant."""
    return load_tiny_pair(tmp_path_factory.mktemp(request.param), default_model_path,
                          **WINDOW_VARIANTS[request.param])


def _tokens(n: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(1000, 40000), k=n)


_GENERATED: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    """transformers' greedy `DECODE` tokens after `prompt` (memoised: generate dominates the
    run time, and every block size asks for the same references)."""
    key = (hf.config.model_type, tuple(prompt))  # one checkpoint per model type here
    if key not in _GENERATED:
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt]),
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=DECODE, min_new_tokens=DECODE,
                              pad_token_id=0)
        _GENERATED[key] = out[0, len(prompt):].tolist()
    return _GENERATED[key]


def test_config_keeps_the_window_per_layer(window_pair) -> None:
    ours, _, cfg, _ = window_pair
    assert cfg.sliding_window == WINDOW and cfg.max_model_len == 2048
    expected = [WINDOW, WINDOW] if cfg.model_type == "mistral" else [None, WINDOW]
    assert ours.layer_windows == expected


# 70 tokens: one query tile; 1100: three tiles (512 rows each at most).
@pytest.mark.parametrize("n", [70, 1100])
def test_prefill_logits_match_transformers(window_pair, monkeypatch, n: int) -> None:
    ours, hf, cfg, _ = window_pair
    ids = _tokens(n, seed=n)
    ref = hf_logits(hf, ids)
    torch.testing.assert_close(PagedDriver(ours).step([(0, ids)])[0], ref, atol=1e-4, rtol=0)
    # Not vacuous: attending fully gives clearly different logits.
    monkeypatch.setattr(ours, "layer_windows", [None] * cfg.num_layers)
    full = PagedDriver(ours).step([(0, ids)])[0]
    assert (full - ref).abs().max() > 1e-2


# Steps a prompt is fed in: one cut (masked cached-context path), a decode-sized last step,
# chunked prefill in 13-token chunks, and a long prompt whose tiles start in cached context.
FEEDS = {"cut": (70, [30]), "last-token": (70, [69]), "chunked": (70, list(range(13, 70, 13))),
         "long": (1100, [600])}


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("feed", sorted(FEEDS))
def test_prefill_over_cached_context_matches_transformers(window_pair, feed: str,
                                                         block_size: int) -> None:
    ours, hf, _, _ = window_pair
    n, cuts = FEEDS[feed]
    ids = _tokens(n, seed=3)
    d = PagedDriver(ours, block_size=block_size, num_blocks=1200 // block_size * 2)
    bounds = [0, *cuts, n]
    got = torch.cat([d.step([(0, ids[a:b])])[0] for a, b in zip(bounds, bounds[1:])])
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("block_size", [16, 4])
def test_greedy_decode_matches_generate(window_pair, block_size: int) -> None:
    ours, hf, _, _ = window_pair
    prompt = _tokens(70, seed=70)  # also in the batched test: one reference for both
    assert PagedDriver(ours, block_size=block_size).greedy(0, prompt, DECODE) == _hf_greedy(hf, prompt)


@pytest.mark.parametrize("block_size", [16, 4])
def test_batched_mixed_lengths_match_generate(window_pair, block_size: int) -> None:
    """Shorter than, equal to and longer than the window, in one prefill step and then one
    decode step per token for all (the short ones cross the window while decoding)."""
    ours, hf, _, _ = window_pair
    prompts = [_tokens(n, seed=n) for n in (3, WINDOW, WINDOW + 1, 30, 70)]
    d = PagedDriver(ours, block_size=block_size, seed=7)
    got = [[int(lg[-1].argmax())] for lg in d.step(list(enumerate(prompts)))]
    for _ in range(DECODE - 1):
        out = d.step([(i, [g[-1]]) for i, g in enumerate(got)])
        for g, lg in zip(got, out):
            g.append(int(lg[-1].argmax()))
    assert got == [_hf_greedy(hf, p) for p in prompts]


@pytest.mark.parametrize("block_size", [16, 4])
def test_engine_chunked_prefill_and_prefix_cache_match_generate(window_pair,
                                                                block_size: int) -> None:
    """The whole engine under a 24-token budget (chunked prefill mixed with decodes), twice:
    the second run reads the prompts' cached blocks (prefill over cached context)."""
    _, hf, _, ckpt = window_pair
    shared = _tokens(40, seed=11)
    prompts = [shared + _tokens(30, seed=12), shared + _tokens(45, seed=13), _tokens(5, seed=14)]
    refs = [_hf_greedy(hf, p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=DECODE, ignore_eos=True)
    with LLM(str(ckpt), device="cpu", dtype="float32", block_size=block_size,
             num_gpu_blocks=1024 // block_size, max_num_batched_tokens=24) as llm:
        reqs = [{"prompt_token_ids": p} for p in prompts]
        first = llm.generate(reqs, params)
        again = llm.generate(reqs, params)
    assert [o.outputs[0].token_ids for o in first] == refs
    assert [o.outputs[0].token_ids for o in again] == refs
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // block_size * block_size
                                                    for p in prompts]
