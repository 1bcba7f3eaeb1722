"""Evaluation metrics: exact values of pass@1, avg@k, unbiased pass@k and maj@k (spec §12)."""

from __future__ import annotations

import itertools
from math import comb

import pytest

from essa.metrics import (
    avg_at_k,
    maj_at_k,
    majority_index,
    mean_pass_at_k,
    pass_at_1,
    pass_at_k,
    sample_metrics,
)
from essa.rewards import MathVerifier, cluster_answers


def test_pass_at_k_spec_examples() -> None:
    assert pass_at_k(16, 4, 8) == pytest.approx(1 - 495 / 12870)  # 0.961538...
    assert round(pass_at_k(16, 4, 8), 4) == 0.9615
    assert pass_at_k(16, 1, 8) == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("n", "c", "k"), [(n, c, k) for n in (1, 5, 16) for c in range(n + 1) for k in range(1, n + 1)]
)
def test_pass_at_k_matches_binomial_form(n: int, c: int, k: int) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


def test_pass_at_k_edges_and_errors() -> None:
    assert pass_at_k(10, 0, 3) == 0.0
    assert pass_at_k(10, 10, 3) == 1.0
    assert pass_at_k(10, 8, 3) == 1.0  # n - c = 2 < k
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c/n
    # Stable where the binomials overflow floats: n = 2000.
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 0)


def test_pass_at_k_is_probability_some_of_k_drawn_is_correct() -> None:
    samples = [1, 0, 0, 1, 0]
    subsets = list(itertools.combinations(samples, 2))
    assert pass_at_k(5, 2, 2) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_1_avg_and_mean_pass() -> None:
    assert pass_at_1([True, False, None, 1]) == 0.5  # None (ungradable) counts as wrong
    correct = [[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert avg_at_k(correct) == pytest.approx((0.75 + 0 + 1) / 3)
    assert avg_at_k(correct, k=2) == pytest.approx((0.5 + 0 + 1) / 3)
    assert mean_pass_at_k(correct, 1) == pytest.approx(avg_at_k(correct))
    assert mean_pass_at_k(correct, 2) == pytest.approx((1 - comb(1, 2) / comb(4, 2) + 0 + 1) / 3)
    with pytest.raises(ValueError, match="k=5"):
        avg_at_k(correct, k=5)
    with pytest.raises(ValueError, match="no problems"):
        pass_at_1([])


def test_majority_and_maj_at_k() -> None:
    assert majority_index(["a", "b", "b", "a"]) == 0  # tie: first occurrence
    assert majority_index([None, "b", "a", "a"]) == 2
    assert majority_index([None]) is None
    keys = [["7", "8", "8", "7", "7"], [None, None, None, None, None], ["1", "2", "3", "3", "1"]]
    correct = [[1, 0, 0, 1, 1], [0, 0, 0, 0, 0], [0, 0, 1, 1, 0]]
    # k=3: p1 votes 8 (wrong), p2 no answer (0), p3 tie 1/2/3 -> 1 (wrong)
    assert maj_at_k(keys, correct, 3) == 0.0
    # k=5: p1 votes 7 (right), p3 tie 1 vs 3 -> 1 (wrong)
    assert maj_at_k(keys, correct, 5) == pytest.approx(1 / 3)
    assert maj_at_k(keys, correct, 1) == pytest.approx(1 / 3)


def test_maj_at_k_with_math_verify_clusters() -> None:
    answers = [r"\frac{1}{2}", "0.5", "3", "3", "1/2"]
    keys = [cluster_answers(answers, MathVerifier())]
    assert keys == [[0, 0, 1, 1, 0]]
    assert maj_at_k(keys, [[1, 1, 0, 0, 1]], 5) == 1.0
    assert maj_at_k(keys, [[1, 1, 0, 0, 1]], 4) == 1.0  # tie 2-2 -> first occurrence (1/2)


def test_sample_metrics_report() -> None:
    correct = [[1, 0, 0, 0], [1, 1, 1, 0]]
    keys = [["a", "b", "b", "c"], ["x", "x", "x", "y"]]
    assert sample_metrics(correct, ks=(1, 4), keys=keys) == pytest.approx(
        {"avg@4": 0.5, "pass@1": 0.5, "pass@4": 1.0, "maj@1": 1.0, "maj@4": 0.5}
    )
