"""Sampler: greedy, temperature, top-k, top-p and per-request seeds, vectorised."""

from __future__ import annotations

import torch

from engine.sampler import Sampler, apply_top_k_top_p
from engine.sampling_params import SamplingParams


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 100, generator=gen(0))
    params = [SamplingParams(temperature=0)] * 5
    assert Sampler()(logits, params, [None] * 5).tolist() == logits.argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    logits = torch.randn(4, 50, generator=gen(1))
    params = [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(temperature=5.0, top_k=1),
              SamplingParams(temperature=0)]
    out = Sampler()(logits, params, [gen(i) for i in range(4)])
    assert out.tolist() == logits.argmax(-1).tolist()


def test_top_k_top_p_mask_matches_definition() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 3)
    probs = logits[0].softmax(-1)
    masked = apply_top_k_top_p(logits, torch.tensor([2, 0, 0]), torch.tensor([1.0, float(probs[0] + 0.01), 1.0]))
    keep = torch.isfinite(masked)
    assert keep[0].tolist() == [True, True, False, False, False]  # top-2
    assert keep[1].tolist() == [True, True, False, False, False]  # nucleus just past p0
    assert keep[2].all()  # both off
    assert torch.equal(masked[keep], logits[keep])


def test_seeded_rows_do_not_depend_on_batch_neighbours() -> None:
    logits = torch.randn(3, 1000, generator=gen(2))
    p = SamplingParams(temperature=1.0, seed=7)
    alone = [Sampler()(logits[1:2], [p], [gen(7)]).item() for _ in range(1)]
    g = gen(7)
    s1 = Sampler()(logits[1:2], [p], [g]).item()
    s2 = Sampler()(logits[1:2], [p], [g]).item()
    g_b = gen(7)
    batched = [
        Sampler()(logits, [SamplingParams(temperature=0), p, SamplingParams(temperature=0.7)], [None, g_b, gen(99)])[
            1
        ].item()
        for _ in range(2)
    ]
    assert alone[0] == s1 and batched == [s1, s2]


def test_sampling_follows_the_distribution_and_respects_top_k() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = gen(3)
    n = 4000
    draws = torch.stack([Sampler()(logits, [SamplingParams(temperature=1.0)], [g]) for _ in range(n)]).flatten()
    freq = torch.bincount(draws, minlength=4).float() / n
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)
    g = gen(4)
    topk = torch.stack([Sampler()(logits, [SamplingParams(top_k=2)], [g]) for _ in range(500)]).flatten()
    assert set(topk.tolist()) == {0, 1}
    # Low temperature sharpens towards the mode.
    g = gen(5)
    cold = torch.stack([Sampler()(logits, [SamplingParams(temperature=0.1)], [g]) for _ in range(500)]).flatten()
    assert (cold == 0).float().mean() > 0.95
