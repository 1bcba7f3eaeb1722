"""Fitness shaping: small NaN-safe pure functions (higher fitness is better, NaN = failed).

Ties get the average of the ranks they span (as ``scipy.stats.rankdata(method="average")``), NaN
entries included: they tie with each other below every number. Breaking ties by position instead
(as OpenAI's ``compute_ranks`` does) turns a flat generation, common with 0/1 accuracy rewards,
into a full-size step in an arbitrary direction; with average ranks constant fitness shapes to all
zeros and two tied candidates always get equal weight. Deterministic and identical on every rank.
"""

from __future__ import annotations

import numpy as np

from essa.types import Fitness


def ranks_nan_worst(fitness: Fitness) -> np.ndarray:
    """Float ranks 0..n-1, 0 = worst; NaN ranks below every number; ties get their average rank.

    >>> ranks_nan_worst(np.array([0.3, np.nan, 0.1, 0.3])).tolist()
    [2.5, 0.0, 1.0, 2.5]
    """
    values = np.asarray(fitness, dtype=np.float64)
    failed = np.isnan(values)
    keys = np.where(failed, 0.0, values)
    # lexsort's last key is the primary one: failed entries (False) sort first.
    order = np.lexsort((keys, ~failed))
    sorted_failed, sorted_keys = failed[order], keys[order]
    starts_group = np.ones(values.size, dtype=bool)  # (n,) True where a run of equal entries starts
    starts_group[1:] = (sorted_failed[1:] != sorted_failed[:-1]) | (
        sorted_keys[1:] != sorted_keys[:-1]
    )
    starts = np.flatnonzero(starts_group)
    ends = np.append(starts[1:], values.size)  # exclusive
    group = np.cumsum(starts_group) - 1  # (n,) group of each sorted position
    ranks = np.empty(values.size, dtype=np.float64)
    ranks[order] = ((starts + ends - 1) / 2.0)[group]
    return ranks


def centered_ranks(fitness: Fitness) -> np.ndarray:
    """OpenAI-ES centered ranks: rank / (n - 1) - 0.5, in [-0.5, 0.5]; NaN gets the lowest.

    Ties share their average rank, so constant fitness gives all zeros. A single value maps to
    0.0 (its rank 0 has nothing to be divided against).

    >>> centered_ranks(np.array([10.0, np.nan, -1.0, 3.0, 7.0])).tolist()
    [0.5, -0.5, -0.25, 0.0, 0.25]
    >>> centered_ranks(np.array([1.0, 1.0, 1.0])).tolist()
    [0.0, 0.0, 0.0]
    """
    ranks = ranks_nan_worst(fitness)
    if ranks.size < 2:
        return np.zeros_like(ranks)
    return ranks / (ranks.size - 1) - 0.5


def fill_failed(fitness: Fitness) -> Fitness:
    """Replace NaN by one finite value strictly below every finite fitness (a copy).

    The gap ``1 + range + |worst|`` stays representable even for huge magnitudes, where
    ``worst - 1`` would round back to ``worst``. All-NaN input is returned unchanged.

    >>> fill_failed(np.array([2.0, np.nan, 5.0])).tolist()
    [2.0, -4.0, 5.0]
    """
    values = np.array(fitness, dtype=np.float64)
    failed = np.isnan(values)
    if failed.all() or not failed.any():
        return values
    worst, best = values[~failed].min(), values[~failed].max()
    values[failed] = worst - (1.0 + (best - worst) + abs(worst))
    return values


def z_score(fitness: Fitness) -> np.ndarray:
    """(f - mean) / std, with NaN first set to the worst finite fitness; constant -> zeros.

    Failures thus weigh like the worst real candidate rather than vanishing from the statistics.

    >>> z_score(np.array([1.0, 3.0, np.nan, 3.0])).tolist()
    [-1.0, 1.0, -1.0, 1.0]
    """
    values = np.array(fitness, dtype=np.float64)
    failed = np.isnan(values)
    if failed.all():
        return np.zeros_like(values)
    values[failed] = values[~failed].min()
    std = values.std()
    if std == 0.0:
        return np.zeros_like(values)
    return (values - values.mean()) / std
