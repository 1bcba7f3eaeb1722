"""Common-random-number sampling (essa.backends.sampling)."""

from __future__ import annotations

import math

import torch

from essa.backends.sampling import crn_sample, row_seed, uniforms, warp


def test_row_seed_is_pure_and_distinct() -> None:
    assert row_seed(7, 3, 1) == row_seed(7, 3, 1)
    seeds = {row_seed(7, i, j) for i in range(20) for j in range(5)}
    assert len(seeds) == 100
    assert row_seed(7, 3, 1) != row_seed(8, 3, 1)


def test_uniforms_are_uniform_and_depend_on_seed_and_step_only() -> None:
    seeds = torch.tensor([row_seed(0, i, 0) for i in range(4000)])
    u = uniforms(seeds, 5)
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    assert abs(float(u.mean()) - 0.5) < 0.02 and abs(float(u.var()) - 1 / 12) < 0.005
    assert torch.equal(uniforms(seeds[100:200], 5), u[100:200])  # a subset draws the same
    assert not torch.equal(uniforms(seeds, 6), u)


def test_samples_follow_the_warped_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    n = 20000
    seeds = torch.tensor([row_seed(1, i, 0) for i in range(n)])
    tokens = crn_sample(logits.expand(n, -1), seeds, 0, temperature=1.0, top_p=1.0)
    freq = torch.bincount(tokens, minlength=4).double() / n
    assert torch.allclose(
        freq, torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64), atol=0.015
    )
    # top_p 0.7 keeps the two most likely tokens (0.5 + 0.3 >= 0.7), renormalised.
    tokens = crn_sample(logits.expand(n, -1), seeds, 0, temperature=1.0, top_p=0.7)
    freq = torch.bincount(tokens, minlength=4).double() / n
    assert freq[2] == 0 and freq[3] == 0 and abs(float(freq[0]) - 0.5 / 0.8) < 0.015


def test_identical_rows_draw_identical_tokens_close_rows_mostly_agree() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    seeds = torch.tensor([row_seed(3, i, 0) for i in range(2000)])
    a = crn_sample(logits.expand(2000, -1), seeds, 4, 0.8, 0.95)
    b = crn_sample(logits.expand(2000, -1).clone(), seeds, 4, 0.8, 0.95)
    assert torch.equal(a, b)
    close = crn_sample(logits.expand(2000, -1) + 1e-3 * torch.randn(2000, 50), seeds, 4, 0.8, 0.95)
    assert float((close == a).double().mean()) > 0.95  # coupled: CRN makes them agree


def test_warp_matches_hf_warpers() -> None:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopPLogitsWarper,
    )

    torch.manual_seed(1)
    scores = torch.randn(3, 40)
    want = TopPLogitsWarper(0.9)(None, TemperatureLogitsWarper(0.7)(None, scores.clone()))
    got = warp(scores, 0.7, 0.9)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    assert torch.allclose(got[finite], want[finite])
    assert not math.isnan(float(got[finite].sum()))
