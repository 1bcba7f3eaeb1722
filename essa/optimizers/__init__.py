"""Gradient-free optimizers over the adapter search vector: numpy (and lazily pycma) only.

Fitness is higher-is-better with NaN = failed evaluation. Every optimizer satisfies the
``Optimizer`` Protocol (ask/tell, plain-data state, checksum); pick one by name:

>>> opt = make_optimizer("openai_es", 3, population_size=4, sigma0=0.1, seed=0)
>>> opt.ask().shape
(4, 3)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from essa.optimizers.base import Optimizer
from essa.optimizers.cma_es import CMAES
from essa.optimizers.openai_es import OpenAIES
from essa.optimizers.shaping import centered_ranks, fill_failed, ranks_nan_worst, z_score

# A factory takes (dim, *, population_size, sigma0, seed, stds, **options) and builds an Optimizer.
OptimizerFactory = Callable[..., Optimizer]

OPTIMIZERS: dict[str, OptimizerFactory] = {
    CMAES.name: CMAES,
    OpenAIES.name: OpenAIES,
}


def make_optimizer(
    name: str,
    dim: int,
    *,
    population_size: int,
    sigma0: float,
    seed: int,
    stds: np.ndarray | None = None,
    **options: Any,
) -> Optimizer:
    """Build the registered optimizer ``name``; ``options`` are its own keyword arguments."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(sorted(OPTIMIZERS))}")
    return OPTIMIZERS[name](
        dim, population_size=population_size, sigma0=sigma0, seed=seed, stds=stds, **options
    )


__all__ = [
    "CMAES",
    "OPTIMIZERS",
    "OpenAIES",
    "Optimizer",
    "OptimizerFactory",
    "centered_ranks",
    "fill_failed",
    "make_optimizer",
    "ranks_nan_worst",
    "z_score",
]
