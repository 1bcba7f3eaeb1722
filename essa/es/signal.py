"""Whether a generation can rank its candidates: the signal of the fitness, per generation.

numpy only. The inputs are per-prompt values, (P, N): candidate c's mean reward on prompt n of
the generation's shared batch (essa.es.generation.prompt_values, gathered over ranks).

* ``split_half``: the split-half reliability of the ranking. The N prompts are cut into two
  random halves; each candidate's mean on one half is rank-correlated (Spearman) with its mean
  on the other, and the Spearman-Brown formula ``2 r / (1 + r)`` turns that half-length
  correlation into the reliability of the whole batch. The correlation is averaged over
  :data:`SPLITS` random cuts (drawn from ``(seed, generation)``, so every rank and a resumed
  run computes the same number) before the correction; a negative mean counts as 0. 1: the batch ranks the candidates as any other batch of the
  same size would; 0: the ranking is noise. Identical candidates, or a half on which every
  candidate scores the same, give 0: nothing can be ranked.
* ``disagree_share``: the share of prompts on which the candidates do not all score the same;
  only those prompts can move the ranking.
* ``zero_margin``: the best candidate's fitness equals the mean (every candidate scores the
  same); the generation moves the search by chance alone.

docs/signal.md gives the formulas and how a run uses them (essa.es.watch).
"""

from __future__ import annotations

import numpy as np

from essa import seeding

SPLITS = 16  # random half-splits averaged per generation


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation of two (P,) vectors (average ranks for ties); 0 where either
    is constant (no ranking to correlate).

    >>> spearman(np.array([1.0, 2.0, 3.0]), np.array([10.0, 20.0, 30.0]))
    1.0
    >>> spearman(np.array([1.0, 1.0, 1.0]), np.array([1.0, 2.0, 3.0]))
    0.0
    """
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = float(np.sqrt((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / denom) if denom > 0 else 0.0


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean of their positions)."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(len(x), dtype=np.float64)
    for value in np.unique(x):
        tied = x == value
        if tied.sum() > 1:
            ranks[tied] = ranks[tied].mean()
    return ranks


def split_half(values: np.ndarray, seed: int, generation: int, splits: int = SPLITS) -> float:
    """Split-half reliability of the candidates' ranking on a (P, N) table of per-prompt
    values (NaN: no score; a candidate's half-mean skips them): the rank correlation of the
    two halves' means averaged over ``splits`` random halves, Spearman-Brown corrected, in
    [0, 1]. 0 with fewer than 2 candidates or 2 prompts.

    >>> v = np.tile(np.arange(4.0)[:, None], (1, 8))  # candidate c scores c on every prompt
    >>> split_half(v, 0, 0)
    1.0
    >>> split_half(np.ones((4, 8)), 0, 0)
    0.0
    """
    p, n = values.shape
    if p < 2 or n < 2:
        return 0.0
    rng = seeding.rng(seed, "es.signal", generation)
    r = 0.0
    for _ in range(splits):
        order = rng.permutation(n)
        a, b = order[: n // 2], order[n // 2 :]
        r += spearman(_row_means(values[:, a]), _row_means(values[:, b])) / splits
    # Spearman-Brown: the reliability of a batch twice the half's length. A negative mean
    # correlation (halves that rank in opposite orders) is no signal: 0.
    return max(0.0, 2 * r / (1 + r))


def _row_means(x: np.ndarray) -> np.ndarray:
    """(P,) mean of each row's finite entries; a row without any counts as the worst (-inf
    would break the ranks' arithmetic, so the row's floor is one below the table's minimum)."""
    means = nan_mean(x)
    floor = np.nanmin(means) - 1.0 if np.isfinite(means).any() else 0.0
    return np.where(np.isfinite(means), means, floor)


def disagree_share(values: np.ndarray) -> float:
    """Share of prompts (columns) on which the candidates' finite values are not all equal.

    >>> disagree_share(np.array([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]]))
    0.3333333333333333
    """
    if values.size == 0:
        return 0.0
    finite = np.isfinite(values)
    hi = np.where(finite, values, -np.inf).max(0)
    lo = np.where(finite, values, np.inf).min(0)
    return float(np.mean(np.isfinite(hi) & np.isfinite(lo) & (hi > lo)))


def signal_record(fitness: np.ndarray, values: np.ndarray, seed: int, g: int) -> dict[str, float]:
    """The generation's signal fields for metrics.jsonl: ``reward_signal`` (split-half
    reliability of the reward's ranking), ``signal`` (of the ranking the search uses: the same
    number where the reward alone ranks; with the tie-breaker, essa.es.generation replaces it),
    ``disagree_share`` and ``zero_margin`` (1.0 or 0.0)."""
    finite = fitness[np.isfinite(fitness)]
    zero = finite.size == 0 or bool(finite.max() - finite.mean() <= 1e-12)
    reliability = round(split_half(values, seed, g), 4)
    return {
        "signal": reliability,
        "reward_signal": reliability,
        "disagree_share": round(disagree_share(values), 4),
        "zero_margin": float(zero),
    }


def nan_mean(x: np.ndarray) -> np.ndarray:
    """Mean over the last axis of the finite entries; NaN, without a warning, where a row has
    none.

    >>> nan_mean(np.array([[1.0, np.nan, 3.0], [np.nan, np.nan, np.nan]])).tolist()
    [2.0, nan]
    """
    finite = np.isfinite(x)
    total = np.where(finite, x, 0.0).sum(-1)
    count = finite.sum(-1)
    return np.divide(total, count, out=np.full(np.shape(total), np.nan), where=count > 0)
