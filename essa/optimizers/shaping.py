"""Fitness shaping: small NaN-safe pure functions (higher fitness is better, NaN = failed).

Ties are broken by position (a stable sort), as in OpenAI's ``compute_ranks``, which keeps the
result deterministic and identical on every rank.
"""

from __future__ import annotations

import numpy as np

from essa.types import Fitness


def ranks_nan_worst(fitness: Fitness) -> np.ndarray:
    """Integer ranks 0..n-1, 0 = worst; NaN ranks below every number, ties keep their order.

    >>> ranks_nan_worst(np.array([0.3, np.nan, 0.1, 0.3])).tolist()
    [2, 0, 1, 3]
    """
    values = np.asarray(fitness, dtype=np.float64)
    failed = np.isnan(values)
    # lexsort is stable; its last key is the primary one: failed entries (False) sort first.
    order = np.lexsort((np.where(failed, 0.0, values), ~failed))
    ranks = np.empty(values.size, dtype=np.int64)
    ranks[order] = np.arange(values.size)
    return ranks


def centered_ranks(fitness: Fitness) -> np.ndarray:
    """OpenAI-ES centered ranks: rank / (n - 1) - 0.5, in [-0.5, 0.5]; NaN gets the lowest.

    A single value maps to 0.0 (its rank 0 has nothing to be divided against).

    >>> centered_ranks(np.array([10.0, np.nan, -1.0, 3.0, 7.0])).tolist()
    [0.5, -0.5, -0.25, 0.0, 0.25]
    """
    ranks = ranks_nan_worst(fitness).astype(np.float64)
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
