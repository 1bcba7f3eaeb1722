"""Decoupled decay of the search mean toward its start, for any ES optimizer; numpy only.

After every ``tell`` the distribution mean moves back toward the start x0 by a fraction eta:

    m <- x0 + (1 - eta) (m - x0)

This is AdamW's decoupled weight decay (Loshchilov & Hutter 2019), taken toward the initial
point as anchored weight decay is, applied to an ES mean after the optimizer's own update. It is
the search's ``optimizer.drift_budget.decay`` (docs/drift-control.md).

How, without a line in any optimizer: :class:`MeanDecay` wraps an optimizer and keeps an offset
t (D,) between its own coordinates and the inner optimizer's. Its candidates are the inner
optimizer's plus t, its mean the inner mean plus t; after each ``tell`` it subtracts
eta (m - x0) from t. Every ES here updates from its candidates relative to its own mean
(CMA-ES from (x - m) / sigma, OpenAI-ES and SNES from the noise that drew them), so shifting its
coordinates changes nothing it computes: the wrapped optimizer is the optimizer whose mean was
moved. The one exception, OpenAI-ES's ``l2coeff`` (a constructor argument, not a config key),
would decay toward zero in the inner coordinates.

- CMA-ES: the evolution paths (p_c, p_sigma), the covariance and sigma accumulate the optimizer's
  own mean steps only; the decay shift is not one of them (decoupled, as AdamW keeps the decay
  out of its moments). The next generation samples around the decayed mean.
- Every ``tell`` decays, skipped generations (all candidates failed, or tied) included: the pull
  is per generation and does not read the fitness.
- The offset is plain data in the state (JSON floats round-trip float64 exactly), so a resumed
  run continues bit for bit, and every MPI rank, telling the same fitness, holds the same offset.

>>> from essa.optimizers import make_optimizer
>>> inner = make_optimizer("openai_es", 2, population_size=4, sigma0=0.1, seed=0)
>>> opt = MeanDecay(inner, 0.5, np.zeros(2))
>>> _ = opt.tell(opt.ask(), np.array([1.0, 0.0, 0.0, 0.0]))
>>> bool(np.allclose(opt.mean, 0.5 * inner.mean))
True
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from essa.optimizers.base import (
    BestSoFar,
    Optimizer,
    as_fitness,
    as_vector,
    canonical_json,
    check_population,
    check_same_config,
    check_state_header,
    sha256_hex,
)
from essa.types import AdapterVector, Fitness, Population

STATE_FORMAT = 1


def with_decay(optimizer: Optimizer, decay: float, x0: AdapterVector) -> Optimizer:
    """``optimizer`` with its mean decayed toward ``x0`` by ``decay`` after every tell; at 0 the
    optimizer itself, unwrapped (its trajectory and checkpoint format unchanged)."""
    return optimizer if decay == 0 else MeanDecay(optimizer, decay, x0)


class MeanDecay(BestSoFar):
    """``inner`` whose mean moves toward ``x0`` by a fraction ``decay`` after every tell."""

    name = "mean_decay"

    def __init__(self, inner: Optimizer, decay: float, x0: AdapterVector) -> None:
        if not (math.isfinite(decay) and 0 <= decay < 1):
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        self.inner = inner
        self._dim = inner.dim
        self._decay = float(decay)
        self._x0 = as_vector(x0, inner.dim, "x0")
        self._config = {"decay": self._decay, "x0": self._x0.tolist()}
        self._offset = np.zeros(inner.dim)  # (D,) this wrapper's coordinates minus the inner's

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def population_size(self) -> int:
        return self.inner.population_size

    @property
    def mean(self) -> AdapterVector:
        return self.inner.mean + self._offset

    @property
    def sigma(self) -> float:
        return self.inner.sigma

    @property
    def generation(self) -> int:
        return self.inner.generation

    @property
    def offset(self) -> AdapterVector:
        """(D,) the decay so far: the mean minus the inner optimizer's mean (a copy)."""
        return self._offset.copy()

    def ask(self) -> Population:
        """(P, D) the inner optimizer's candidates, shifted by the offset."""
        return self.inner.ask() + self._offset

    def tell(self, population: Population, fitness: Fitness, **options: Any) -> dict[str, float]:
        """The inner optimizer's tell (``options``: its own, e.g. CMA-ES's ``flat``), then the
        decay of the mean it reached."""
        fitness = as_fitness(fitness, self.population_size)
        check_population(population, self.ask())
        self._update_best(np.asarray(population, dtype=np.float64), fitness)
        metrics = self.inner.tell(self.inner.ask(), fitness, **options)  # type: ignore[call-arg]
        shift = -self._decay * (self.mean - self._x0)  # (D,)
        self._offset = self._offset + shift
        return {**metrics, "decay_step_norm": float(np.linalg.norm(shift))}

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.name,
            "format": STATE_FORMAT,
            "config": dict(self._config),
            "offset": self._offset.tolist(),
            "inner": self.inner.state_dict(),
            **self._best_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state_header(state, self.name, STATE_FORMAT)
        check_same_config(state["config"], self._config, self.name)
        self.inner.load_state_dict(state["inner"])
        self._offset = as_vector(state["offset"], self._dim, "offset")
        self._load_best(state)

    def checksum(self) -> str:
        """sha256 over the decay's state and the inner optimizer's own checksum."""
        state = self.state_dict()
        state.pop("inner")
        return sha256_hex(canonical_json(state).encode(), self.inner.checksum().encode())
