"""sample_index: every sampled token is drawn by it, so its draws must follow p exactly."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from specserve.speculation.verify import sample_index


def test_draws_follow_p_and_never_take_a_zero():
    g = torch.Generator().manual_seed(3)
    p = torch.tensor([0.0, 0.05, 0.0, 0.4, 0.15, 0.0, 0.3, 0.1, 0.0])  # zeros at both ends too
    n = 20000
    counts = torch.bincount(torch.tensor([sample_index(p, g) for _ in range(n)]),
                            minlength=p.numel())
    assert counts[p == 0].sum() == 0
    support = p > 0
    assert chisquare(counts[support].numpy(), (p[support] * n).numpy()).pvalue > 1e-3


def test_unnormalised_p_is_the_same_distribution():
    p = torch.tensor([2.0, 0.0, 6.0])
    draws = [sample_index(p, torch.Generator().manual_seed(s)) for s in range(4000)]
    assert set(draws) == {0, 2}
    assert chisquare([draws.count(0), draws.count(2)], [1000, 3000]).pvalue > 1e-3


def test_a_uniform_draw_that_rounds_up_to_the_total_takes_the_last_index_with_mass(monkeypatch):
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(1.0, dtype=torch.float64))
    assert sample_index(torch.tensor([0.2, 0.8, 0.0, 0.0]), torch.Generator()) == 1


def test_a_one_hot_always_draws_its_index():
    g = torch.Generator().manual_seed(0)
    p = torch.zeros(49152)
    p[31337] = 1.0
    assert {sample_index(p, g) for _ in range(50)} == {31337}
