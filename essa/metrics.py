"""Evaluation metrics over sampled completions (spec rewards-and-eval.md §12). Pure Python.

Inputs are per problem: ``correct[p][j]`` says whether sample j of problem p is correct
(truthy = correct; grade ungradable samples as wrong before calling), and for maj@k
``keys[p][j]`` is the sample's answer cluster (any hashable; None = no answer), e.g. from
:func:`essa.rewards.cluster_answers` (math-verify equivalence) or a normalised answer string.
Every metric is a mean over problems.

- pass@1 (greedy): one sample per problem, correct or not.
- avg@k (mean@k): the mean accuracy of the first k samples; the unbiased pass@1 from k samples.
- pass@k: the unbiased estimator of Chen et al. (2021) from n >= k samples with c correct,
  ``1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (product form, stable).
- maj@k: majority vote over the first k samples' answer clusters (ties: the first occurrence),
  scored by the correctness of the first sample holding the voted answer; 0 with no answers.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence


def _mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("no problems to average over")
    return math.fsum(values) / len(values)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem: ``1 - C(n-c, k)/C(n, k)``; 1.0 when ``n - c < k``.

    >>> round(pass_at_k(16, 4, 8), 4), pass_at_k(16, 1, 8), pass_at_k(5, 0, 3)
    (0.9615, 0.5, 0.0)
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def pass_at_1(correct: Sequence[object]) -> float:
    """Greedy pass@1: the mean over problems of one sample's correctness.

    >>> pass_at_1([True, False, True, True])
    0.75
    """
    return _mean([float(bool(value)) for value in correct])


def avg_at_k(correct: Sequence[Sequence[object]], k: int | None = None) -> float:
    """avg@k: mean over problems of the accuracy of the first ``k`` samples (all if None).

    >>> avg_at_k([[1, 0, 1, 1], [0, 0, 1, 0]])
    0.5
    >>> avg_at_k([[1, 0, 1, 1], [0, 0, 1, 0]], k=2)
    0.25
    """
    per_problem = []
    for samples in correct:
        chosen = samples if k is None else _first(samples, k)
        per_problem.append(_mean([float(bool(value)) for value in chosen]))
    return _mean(per_problem)


def mean_pass_at_k(correct: Sequence[Sequence[object]], k: int) -> float:
    """pass@k averaged over problems, each from all its samples (:func:`pass_at_k`).

    >>> mean_pass_at_k([[1, 0, 0, 0], [0, 0, 0, 0]], k=2)
    0.25
    """
    return _mean([pass_at_k(len(samples), sum(bool(v) for v in samples), k) for samples in correct])


def majority_index(keys: Sequence[Hashable | None]) -> int | None:
    """Index of the first sample of the most common key (None does not vote; ties go to the
    key seen first); None when no sample has a key.

    >>> majority_index(["b", "a", None, "a", "b"]), majority_index([None, None])
    (0, None)
    """
    counts = Counter(key for key in keys if key is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(i for i, key in enumerate(keys) if key is not None and counts[key] == best)


def maj_at_k(
    keys: Sequence[Sequence[Hashable | None]], correct: Sequence[Sequence[object]], k: int
) -> float:
    """maj@k: per problem, the correctness of the majority answer of the first ``k`` samples.

    >>> maj_at_k([["7", "8", "8"], ["1", None, "2"]], [[1, 0, 0], [0, 0, 1]], k=3)
    0.0
    >>> maj_at_k([["7", "8", "8"]], [[1, 0, 0]], k=1)
    1.0
    """
    if len(keys) != len(correct):
        raise ValueError(f"keys cover {len(keys)} problems, correct {len(correct)}")
    per_problem = []
    for problem_keys, problem_correct in zip(keys, correct, strict=True):
        if len(problem_keys) != len(problem_correct):
            raise ValueError("keys and correct differ in samples for a problem")
        voted = majority_index(_first(problem_keys, k))
        per_problem.append(0.0 if voted is None else float(bool(problem_correct[voted])))
    return _mean(per_problem)


def _first(samples: Sequence[object], k: int) -> Sequence[object]:
    if not 1 <= k <= len(samples):
        raise ValueError(f"k={k} needs 1..{len(samples)} samples per problem")
    return samples[:k]


def sample_metrics(
    correct: Sequence[Sequence[object]],
    ks: Sequence[int] = (1,),
    keys: Sequence[Sequence[Hashable | None]] | None = None,
) -> dict[str, float]:
    """``avg@n`` (n = the fewest samples of any problem), ``pass@k`` for each k in ``ks``, and
    ``maj@k`` for each k when ``keys`` are given; keys are ``"avg@8"``, ``"pass@4"``, ...

    >>> sample_metrics([[1, 0], [0, 0]], ks=(1, 2), keys=[["a", "b"], ["c", "c"]])
    {'avg@2': 0.25, 'pass@1': 0.25, 'pass@2': 0.5, 'maj@1': 0.5, 'maj@2': 0.5}
    """
    n = min(len(samples) for samples in correct) if correct else 0
    metrics = {f"avg@{n}": avg_at_k(correct, n)}
    for k in ks:
        metrics[f"pass@{k}"] = mean_pass_at_k(correct, k)
    if keys is not None:
        for k in ks:
            metrics[f"maj@{k}"] = maj_at_k(keys, correct, k)
    return metrics
