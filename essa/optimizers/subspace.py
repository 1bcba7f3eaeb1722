"""Search a subset of the coordinates; the others stay where they start.

ESSA's relative steps scale coordinate i by its SFT singular value. A singular value of zero
(a LoRA factor of lower rank than r, or a module whose B was never trained) would get a zero
step: it cannot be searched relatively, and pycma and the OpenAI-ES whitening refuse a zero
scale. :class:`Subspace` runs any optimizer on the ``free`` coordinates only and holds the rest
at ``x0``, so the inner optimizer's dimension is the number of values actually searched.

>>> from essa.optimizers import make_optimizer
>>> free = np.array([True, False, True])
>>> inner = make_optimizer("openai_es", 2, population_size=4, sigma0=0.1, seed=0)
>>> opt = Subspace(inner, free, np.array([0.0, 7.0, 0.0]))
>>> opt.ask()[:, 1].tolist()
[7.0, 7.0, 7.0, 7.0]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from essa.optimizers.base import (
    Optimizer,
    as_vector,
    canonical_json,
    check_population,
    check_same_config,
    check_state_header,
    sha256_hex,
)
from essa.types import AdapterVector, Fitness, Population

STATE_FORMAT = 1


class Subspace:
    """``inner`` over the ``free`` coordinates of a (D,) vector; the others fixed at ``x0``."""

    name = "subspace"

    def __init__(self, inner: Optimizer, free: np.ndarray, x0: AdapterVector) -> None:
        self.inner = inner
        self._free = np.asarray(free, dtype=bool)  # (D,)
        if self._free.ndim != 1 or int(self._free.sum()) != inner.dim:
            raise ValueError(f"free must be (D,) bool with {inner.dim} True entries")
        self._x0 = as_vector(x0, self._free.size, "x0")
        self._config = {
            "free": np.flatnonzero(self._free).tolist(),
            "fixed": self._x0[~self._free].tolist(),
        }

    def _full(self, sub: np.ndarray) -> np.ndarray:
        """(..., d) free values -> (..., D) with the fixed coordinates at x0."""
        out = np.broadcast_to(self._x0, sub.shape[:-1] + self._x0.shape).copy()
        out[..., self._free] = sub
        return out

    @property
    def dim(self) -> int:
        return int(self._free.size)

    @property
    def population_size(self) -> int:
        return self.inner.population_size

    @property
    def mean(self) -> AdapterVector:
        return self._full(self.inner.mean)

    @property
    def sigma(self) -> float:
        return self.inner.sigma

    @property
    def generation(self) -> int:
        return self.inner.generation

    @property
    def best_x(self) -> AdapterVector | None:
        best = self.inner.best_x
        return None if best is None else self._full(best)

    @property
    def best_fitness(self) -> float:
        return self.inner.best_fitness

    def ask(self) -> Population:
        """(P, D): the inner population on the free coordinates, x0 elsewhere."""
        return self._full(self.inner.ask())

    def tell(self, population: Population, fitness: Fitness, **options: Any) -> dict[str, float]:
        """The inner optimizer's tell on the free coordinates (``options``: its own, e.g.
        CMA-ES's ``flat``)."""
        check_population(population, self.ask())
        sub = np.asarray(population, dtype=np.float64)[:, self._free]  # (P, d)
        return self.inner.tell(sub, fitness, **options)  # type: ignore[call-arg]

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.name,
            "format": STATE_FORMAT,
            "config": dict(self._config),
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state_header(state, self.name, STATE_FORMAT)
        check_same_config(state["config"], self._config, self.name)
        self.inner.load_state_dict(state["inner"])

    def checksum(self) -> str:
        """sha256 over the fixed layout and the inner optimizer's own checksum."""
        return sha256_hex(canonical_json(self._config).encode(), self.inner.checksum().encode())
