"""SNES, separable natural evolution strategies (Schaul, Glasmachers & Schmidhuber 2011, "High
dimensions and heavy tails for natural evolution strategies"; Wierstra et al. 2014, "Natural
Evolution Strategies", JMLR 15, Algorithm 6), maximising fitness.

The search distribution is a Gaussian with mean mu and one standard deviation per coordinate,
sigma (both (D,)); both follow the natural gradient of expected fitness, estimated from ranks:

    s_k ~ N(0, I),  z_k = mu + sigma * s_k                                 k = 1..lambda
    u_k = max(0, ln(lambda/2 + 1) - ln k) / sum_j max(0, ln(lambda/2 + 1) - ln j) - 1/lambda
          (k: the candidate's rank, 1 = best; the utilities sum to 0)
    grad_mu = sum_k u_k s_k,    grad_sigma = sum_k u_k (s_k^2 - 1)
    mu    <- mu + eta_mu * sigma * grad_mu
    sigma <- sigma * exp(eta_sigma / 2 * grad_sigma)

Defaults as in the papers: eta_mu = 1, eta_sigma = (3 + ln D) / (5 sqrt D). The population is
the caller's (the papers' default is 4 + floor(3 ln D)). Cost: O(lambda D) per generation.

Where this departs from the papers or makes a choice they leave open:

- Noise comes from seeds: generation g's (lambda, D) draws ``s`` are
  ``essa.seeding.rng(seed, "snes.samples", g).standard_normal((lambda, D))``, a pure function of
  three integers, so every rank draws the same candidates and a resume needs no generator state.
- Relative steps: with per-coordinate ``stds`` sigma starts at ``sigma0 * stds``. The Protocol's
  one global ``sigma`` is the geometric mean of ``sigma / stds`` (sigma0 at the start).
- Ties share the average of the utilities their ranks span; NaN fitness (a failed evaluation)
  ranks below every number, failures tied among themselves. Constant fitness therefore gives
  u = 0: mean and sigma stay exactly where they are.
- A generation where every candidate failed is skipped (no update) but counted, so the next one
  draws new noise; ``enable_raise_on_all_failed=True`` raises instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

import essa.seeding as seeding
from essa.optimizers.base import (
    BestSoFar,
    EsOptimizerSpec,
    EsOptions,
    as_fitness,
    as_vector,
    canonical_json,
    check_common_args,
    check_population,
    check_same_config,
    check_state_header,
    fitness_metrics,
    sha256_hex,
)
from essa.optimizers.shaping import ranks_nan_worst
from essa.types import AdapterVector, Fitness, Population

STATE_FORMAT = 1
SAMPLES = "snes.samples"  # generation g's unit draws (keys: generation)


def default_eta_sigma(dim: int) -> float:
    """(3 + ln D) / (5 sqrt D), the papers' sigma learning rate.

    >>> round(default_eta_sigma(100), 4)
    0.1521
    """
    return (3.0 + math.log(dim)) / (5.0 * math.sqrt(dim))


def rank_utilities(fitness: Fitness) -> np.ndarray:
    """(P,) NES utilities by rank (best first: max(0, ln(P/2+1) - ln k), normalised, minus 1/P);
    tied candidates (failures among them) share the mean of the utilities their ranks span.

    >>> rank_utilities(np.array([0.0, 2.0, np.nan, 1.0])).round(4).tolist()
    [-0.25, 0.4804, -0.25, 0.0196]
    >>> rank_utilities(np.array([3.0, 3.0, 3.0])).tolist()
    [0.0, 0.0, 0.0]
    """
    n = fitness.size
    raw = np.maximum(0.0, math.log(n / 2 + 1) - np.log(np.arange(1, n + 1)))  # (P,) best first
    worst_first = (raw / raw.sum() - 1.0 / n)[::-1]  # (P,) utility of sorted position 0 = worst
    ranks = ranks_nan_worst(fitness)  # (P,) 0 = worst; a tie group's mean position
    utilities = np.zeros(n)
    groups = np.unique(ranks)
    if groups.size == 1:  # all tied: exactly no information (the mean would be ~1e-17, not 0)
        return utilities
    for rank in groups:
        members = ranks == rank
        size = int(members.sum())
        first = int(rank - (size - 1) / 2)  # the group spans sorted positions first..first+size-1
        utilities[members] = worst_first[first : first + size].mean()
    return utilities


class SNES(BestSoFar):
    """Separable NES over a (D,) vector with seed-based draws; see the module docstring."""

    name = "snes"

    def __init__(
        self,
        dim: int,
        *,
        population_size: int,  # lambda
        sigma0: float,  # initial standard deviation, relative to stds
        seed: int,  # generation g draws from snes.samples at (g)
        stds: np.ndarray | None = None,  # (D,) per-coordinate scales of the initial sigma
        x0: np.ndarray | None = None,  # (D,) initial mean; zeros = the SFT adapter in ESSA
        eta_mu: float = 1.0,  # mean learning rate
        eta_sigma: float | None = None,  # sigma learning rate; None: (3 + ln D) / (5 sqrt D)
        enable_raise_on_all_failed: bool = False,  # raise instead of skipping all-NaN generations
    ) -> None:
        check_common_args(dim, population_size, sigma0, seed)
        eta_sigma = default_eta_sigma(dim) if eta_sigma is None else float(eta_sigma)
        for key, rate in (("eta_mu", eta_mu), ("eta_sigma", eta_sigma)):
            if not (math.isfinite(rate) and rate > 0):
                raise ValueError(f"{key} must be finite and > 0, got {rate!r}")
        self._dim = dim
        self._population_size = population_size
        self._seed = seed
        mean0 = np.zeros(dim) if x0 is None else as_vector(x0, dim, "x0")
        self._stds = np.ones(dim) if stds is None else as_vector(stds, dim, "stds", positive=True)
        self._enable_raise_on_all_failed = enable_raise_on_all_failed
        self._config: dict[str, Any] = {
            "dim": dim,
            "population_size": population_size,
            "sigma0": float(sigma0),
            "seed": seed,
            "x0": mean0.tolist(),
            "stds": None if stds is None else self._stds.tolist(),
            "eta_mu": float(eta_mu),
            "eta_sigma": eta_sigma,
        }
        self._mean = mean0
        self._sigmas = float(sigma0) * self._stds  # (D,) per-coordinate standard deviations
        self._generation = 0
        self._n_skipped = 0
        self._pending: Population | None = None

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def population_size(self) -> int:
        return self._population_size

    @property
    def mean(self) -> AdapterVector:
        return self._mean.copy()

    @property
    def sigma(self) -> float:
        """Geometric mean of sigma / stds: one step size, as a layerwise switch carries on."""
        return float(np.exp(np.mean(np.log(self._sigmas / self._stds))))

    @property
    def sigmas(self) -> np.ndarray:
        """(D,) per-coordinate standard deviations (a copy)."""
        return self._sigmas.copy()

    @property
    def generation(self) -> int:
        return self._generation

    def _unit_draws(self) -> np.ndarray:
        """(P, D) standard normal draws of the current generation."""
        rng = seeding.rng(self._seed, SAMPLES, self._generation)
        return rng.standard_normal((self._population_size, self._dim))

    def ask(self) -> Population:
        """(P, D) candidates mu + sigma * s; a pure function of (mu, sigma, seed, generation)."""
        if self._pending is None:
            self._pending = self._mean + self._sigmas * self._unit_draws()
        return self._pending.copy()

    def tell(self, population: Population, fitness: Fitness) -> dict[str, float]:
        """One natural-gradient step of mu and sigma; NaN = failed, ranked worst."""
        fitness = as_fitness(fitness, self._population_size)
        if self._pending is None:
            self.ask()
        assert self._pending is not None
        check_population(population, self._pending)
        all_failed = bool(np.all(np.isnan(fitness)))
        if all_failed and self._enable_raise_on_all_failed:
            raise RuntimeError(
                f"all {fitness.size} evaluations failed (NaN) in generation {self._generation}"
            )
        step_norm = 0.0
        if all_failed:
            self._n_skipped += 1
        else:
            self._update_best(self._pending, fitness)
            step_norm = self._step(fitness)
        self._generation += 1
        self._pending = None
        return {
            **fitness_metrics(fitness),
            "sigma": self.sigma,
            "step_norm": step_norm,
            "skipped": float(all_failed),
            "generation": float(self._generation),
        }

    def _step(self, fitness: Fitness) -> float:
        """Utilities, the two natural gradients, the update; returns the mean step's norm."""
        draws = self._unit_draws()  # (P, D) the s_k of this generation
        utilities = rank_utilities(fitness)  # (P,)
        grad_mu = utilities @ draws  # (D,)
        grad_sigma = utilities @ (draws * draws - 1.0)  # (D,)
        step = self._config["eta_mu"] * self._sigmas * grad_mu  # (D,) with the sigma drawn from
        self._mean = self._mean + step
        self._sigmas = self._sigmas * np.exp(0.5 * self._config["eta_sigma"] * grad_sigma)
        return float(np.linalg.norm(step))

    def state_dict(self) -> dict[str, Any]:
        """Mean, sigmas and counters as plain lists (float64 -> float is exact)."""
        return {
            "optimizer": self.name,
            "format": STATE_FORMAT,
            "config": dict(self._config),
            "generation": self._generation,
            "n_skipped": self._n_skipped,
            "mean": self._mean.tolist(),
            "sigmas": self._sigmas.tolist(),
            **self._best_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a ``state_dict()`` of an optimizer built with the same arguments."""
        check_state_header(state, self.name, STATE_FORMAT)
        check_same_config(state["config"], self._config, self.name)
        self._generation = int(state["generation"])
        self._n_skipped = int(state["n_skipped"])
        self._mean = as_vector(state["mean"], self._dim, "mean")
        self._sigmas = as_vector(state["sigmas"], self._dim, "sigmas", positive=True)
        self._load_best(state)
        self._pending = None

    def checksum(self) -> str:
        """sha256 of the canonical JSON state (floats in shortest round-trip form)."""
        return sha256_hex(canonical_json(self.state_dict()).encode())


@dataclass(frozen=True)
class SNESOptions(EsOptions):
    """SNES's own keys of the config's ``optimizer`` section."""

    eta_mu: float = 1.0  # mean learning rate
    eta_sigma: float | None = None  # sigma learning rate; null: (3 + ln D) / (5 sqrt D)

    def check(self, population_size: int, *, layerwise: bool) -> None:
        for key, rate in (("eta_mu", self.eta_mu), ("eta_sigma", self.eta_sigma)):
            if rate is not None and rate <= 0:
                raise ValueError(f"{key}: must be > 0, got {rate}")


SPEC = EsOptimizerSpec(
    name=SNES.name, factory=SNES, options=SNESOptions, seed_domains={SAMPLES: 201}
)
