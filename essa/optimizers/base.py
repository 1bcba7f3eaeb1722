"""The optimizer contract (a Protocol, not a base class) and the small checks every optimizer shares.

Conventions for all optimizers in this package:

- Fitness is higher-is-better, float64, shape (population_size,). NaN marks a failed evaluation
  and is ranked below every number. +-inf is rejected: no reward produces it, so it is a bug.
- ``ask()`` is idempotent: it returns the same population until ``tell()`` is called, so every
  rank (and every retry) sees identical candidates.
- ``state_dict()`` is plain JSON data (dicts, lists, str, int, float, None); NaN is stored as None.
  No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from essa.types import AdapterVector, Fitness, Population


@runtime_checkable
class Optimizer(Protocol):
    """Ask/tell evolution strategy over a (dim,) float64 search vector; maximises fitness."""

    @property
    def dim(self) -> int:
        """Dimension D of the search vector."""
        ...

    @property
    def population_size(self) -> int:
        """Number of candidates P returned by ``ask()``."""
        ...

    @property
    def mean(self) -> AdapterVector:
        """(D,) current distribution mean (a copy)."""
        ...

    @property
    def sigma(self) -> float:
        """Current global step size."""
        ...

    @property
    def generation(self) -> int:
        """Number of ``tell()`` calls so far, skipped (all-failed) generations included."""
        ...

    @property
    def best_x(self) -> AdapterVector | None:
        """Best evaluated candidate so far (a copy); None until a finite fitness was told."""
        ...

    @property
    def best_fitness(self) -> float:
        """Fitness of ``best_x``; NaN until a finite fitness was told."""
        ...

    def ask(self) -> Population:
        """(P, D) float64 candidates; identical on repeated calls until ``tell()``."""
        ...

    def tell(self, population: Population, fitness: Fitness) -> dict[str, float]:
        """Update from the population returned by ``ask()`` and its fitness; returns metrics."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state; with the same constructor arguments it resumes exactly."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state produced by ``state_dict()`` of an optimizer built with the same args."""
        ...

    def checksum(self) -> str:
        """sha256 hex digest of the state, compared across MPI ranks."""
        ...


# A factory takes (dim, *, population_size, sigma0, seed, stds, x0, **options) and builds an
# Optimizer; ``options`` are its own keyword arguments (``EsOptions.kwargs``).
OptimizerFactory = Callable[..., Optimizer]


@dataclass(frozen=True)
class EsOptions:
    """An ES optimizer's own config keys, as a small frozen dataclass subclassing this one; every
    field has a default. The config's ``optimizer`` section holds them flat, next to the keys all
    optimizers share (name, population_size, sigma0, ...).

    The methods below are what the rest of essa asks about the options; an optimizer overrides
    those where it differs from these defaults (no checks, single candidates, every field a
    constructor argument, nothing extra for ``tell``).
    """

    def check(self, population_size: int, *, layerwise: bool) -> None:
        """Raise ValueError("KEY: why") on values the optimizer cannot run with; KEY is an option's
        name or a shared key's (``population_size``), which the config prefixes with its section.
        ``layerwise``: the optimizer runs inside layerwise ES (essa.optimizers.layerwise)."""

    def pair_size(self) -> int:
        """Candidates that are drawn together: 2 where pairs are antithetic (m +- sigma z), else 1.
        A population that has to shrink (essa.es.plan) shrinks by whole pairs."""
        return 1

    def kwargs(self) -> dict[str, Any]:
        """The optimizer's constructor arguments these options set."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def tell_kwargs(self, *, reward_flat: bool) -> dict[str, Any]:
        """Extra arguments of one generation's ``tell``; ``reward_flat``: the generation's task
        reward (before any tie-breaker) ranked no candidate above another."""
        return {}


@dataclass(frozen=True)
class EsOptimizerSpec:
    """A registry entry (essa.optimizers.register): all that the rest of essa asks about an ES
    optimizer, so that the optimizer is one module and one registry line."""

    name: str  # ``optimizer.name`` in the config; the ``optimizer`` field of its state_dict
    factory: OptimizerFactory  # (dim, *, population_size, sigma0, seed, stds, x0, **kwargs)
    options: type[EsOptions]  # its config keys; the defaults are the config's defaults
    # Its random streams: essa.seeding domain -> tag (the tag fixes the stream; keep it stable).
    seed_domains: Mapping[str, int]


def check_common_args(dim: int, population_size: int, sigma0: float, seed: int) -> None:
    """Raise ValueError on arguments no optimizer can work with."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim must be a positive int, got {dim!r}")
    if isinstance(population_size, bool) or not isinstance(population_size, int):
        raise ValueError(f"population_size must be an int, got {population_size!r}")
    if population_size < 2:
        raise ValueError(f"population_size must be >= 2, got {population_size}")
    if not (math.isfinite(sigma0) and sigma0 > 0):
        raise ValueError(f"sigma0 must be finite and > 0, got {sigma0!r}")
    # SeedSequence rejects negative entries; bool is an int subclass but never a meant seed.
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")


def as_vector(values: Any, dim: int, name: str, *, positive: bool = False) -> AdapterVector:
    """Copy ``values`` to a finite (dim,) float64 vector, or raise ValueError naming ``name``."""
    vector = np.array(values, dtype=np.float64)
    if vector.shape != (dim,):
        raise ValueError(f"{name} must have shape ({dim},), got {vector.shape}")
    if not np.all(np.isfinite(vector)):
        raise ValueError(f"{name} must be finite")
    if positive and not np.all(vector > 0):
        raise ValueError(f"{name} must be > 0 everywhere")
    return vector


def as_fitness(fitness: Any, population_size: int) -> Fitness:
    """Validate told fitness: (population_size,) float64; None becomes NaN; +-inf is rejected."""
    values = np.array(fitness, dtype=np.float64)
    if values.shape != (population_size,):
        raise ValueError(f"fitness must have shape ({population_size},), got {values.shape}")
    if np.any(np.isinf(values)):
        raise ValueError("fitness contains +-inf; mark a failed evaluation with NaN instead")
    return values


def check_population(population: Any, expected: Population) -> None:
    """Raise ValueError unless ``population`` is exactly the one ``ask()`` returned.

    The update regenerates the noise from seeds / uses pycma's own samples, so fitness of any
    other points would be attributed to the wrong candidates.
    """
    given = np.asarray(population)
    if given.shape != expected.shape or not np.array_equal(given, expected):
        raise ValueError("tell() must receive the exact population returned by the last ask()")


def fitness_metrics(fitness: Fitness) -> dict[str, float]:
    """Best/mean/worst over finite fitness (NaN when all failed) and the failure count."""
    finite = fitness[~np.isnan(fitness)]
    if finite.size == 0:
        best = mean = worst = math.nan
    else:
        best, mean, worst = float(finite.max()), float(finite.mean()), float(finite.min())
    return {
        "fitness_best": best,
        "fitness_mean": mean,
        "fitness_worst": worst,
        "n_failed": float(fitness.size - finite.size),
    }


def update_best(
    best_x: AdapterVector | None, best_fitness: float, population: Population, fitness: Fitness
) -> tuple[AdapterVector | None, float]:
    """Keep the best finite candidate seen so far; NaN can never win, ties keep the older one."""
    if np.all(np.isnan(fitness)):
        return best_x, best_fitness
    index = int(np.nanargmax(fitness))
    if best_x is None or fitness[index] > best_fitness:
        return population[index].copy(), float(fitness[index])
    return best_x, best_fitness


class BestSoFar:
    """The best finite candidate told so far, shared by every optimizer (NaN never wins)."""

    _dim: int
    _best_x: AdapterVector | None = None
    _best_fitness: float = math.nan

    @property
    def best_x(self) -> AdapterVector | None:
        return None if self._best_x is None else self._best_x.copy()

    @property
    def best_fitness(self) -> float:
        return self._best_fitness

    def _update_best(self, population: Population, fitness: Fitness) -> None:
        self._best_x, self._best_fitness = update_best(
            self._best_x, self._best_fitness, population, fitness
        )

    def _best_state(self) -> dict[str, Any]:
        return {
            "best_x": None if self._best_x is None else self._best_x.tolist(),
            "best_fitness": float_to_json(self._best_fitness),
        }

    def _load_best(self, state: Mapping[str, Any]) -> None:
        best = state["best_x"]
        self._best_x = None if best is None else as_vector(best, self._dim, "best_x")
        self._best_fitness = float_from_json(state["best_fitness"])


def fitness_to_json(fitness: Fitness) -> list[float | None]:
    """Fitness as a JSON list; NaN (not valid JSON) becomes None."""
    return [None if math.isnan(value) else value for value in fitness.tolist()]


def fitness_from_json(values: list[float | None]) -> Fitness:
    """Inverse of ``fitness_to_json``."""
    return np.array([math.nan if value is None else value for value in values], dtype=np.float64)


def float_to_json(value: float) -> float | None:
    """A float for JSON; NaN becomes None."""
    return None if math.isnan(value) else float(value)


def float_from_json(value: float | None) -> float:
    """Inverse of ``float_to_json``."""
    return math.nan if value is None else float(value)


def canonical_json(state: Any) -> str:
    """Deterministic JSON text: sorted keys, no spaces, shortest round-trip float repr."""
    return json.dumps(state, sort_keys=True, separators=(",", ":"), allow_nan=False)


def sha256_hex(*chunks: bytes) -> str:
    """sha256 hex digest of the concatenated chunks."""
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def check_same_config(saved: Mapping[str, Any], current: Mapping[str, Any], name: str) -> None:
    """Raise ValueError naming every key on which a saved state's config differs from ours.

    A state only resumes exactly under the constructor arguments it was produced with.
    """
    keys = sorted(set(saved) | set(current))
    differing = [key for key in keys if saved.get(key) != current.get(key)]
    if differing:
        raise ValueError(
            f"{name} state was saved with different constructor arguments: {', '.join(differing)}"
        )


def check_state_header(state: Mapping[str, Any], name: str, state_format: int) -> None:
    """Raise ValueError if ``state`` was not produced by optimizer ``name`` in this format."""
    if state.get("optimizer") != name or state.get("format") != state_format:
        raise ValueError(
            f"not a {name} state (format {state_format}): "
            f"optimizer={state.get('optimizer')!r}, format={state.get('format')!r}"
        )
