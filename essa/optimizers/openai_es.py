"""OpenAI-ES (Salimans et al. 2017, "Evolution Strategies as a Scalable Alternative to RL").

Follows ``openai/evolution-strategies-starter``: antithetic pairs ``mean +- sigma * eps``, centered
ranks over all returns, ``g = sum_pairs (r+ - r-) * eps / population_size``, and Adam (or SGD) on
``-g + l2coeff * theta``. Where this departs from it:

- Noise comes from integer seeds, not a shared 1 GB noise table: pair i of generation g uses
  ``eps = essa.seeding.rng(seed, "openai_es.noise", g, i).standard_normal(D)``. Any rank can
  rebuild any candidate from three integers, and nothing but fitness has to cross processes.
- The 1/sigma of the score-function estimator is left out of ``g``, as in the starter code: it is
  absorbed by ``lr``. With Adam the gradient scale cancels anyway (up to ``adam_epsilon``).
- Relative steps: with per-coordinate ``stds`` the search runs in the whitened coordinates
  ``z = x / stds``. The perturbation is ``sigma * stds * eps``, the gradient and the step rule
  (Adam moments, weight decay ``l2coeff * z``) live in z, and the step is mapped back by
  ``* stds``. Without ``stds`` this is exactly the starter code's update.
- sigma is constant (no schedule); ``shaping="z_score"`` is offered besides centered ranks.
- Ties get their average centered rank (the starter code breaks them by position): a tied
  antithetic pair contributes nothing, and constant fitness gives ``g = 0``, so from fresh
  moments the step is exactly zero (later, Adam's or SGD's momentum still carries the mean on).
- NaN fitness = failed, ranked worst. A generation where every candidate failed is skipped (no step,
  Adam's t unchanged) but counted, so the next generation draws new noise;
  ``enable_raise_on_all_failed=True`` raises instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

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
from essa.optimizers.shaping import centered_ranks, z_score
from essa.optimizers.steps import adam_step, sgd_step
from essa.types import AdapterVector, Fitness, Population, Seed

StepRule = Literal["adam", "sgd"]
Shaping = Literal["centered_ranks", "z_score"]
STATE_FORMAT = 1
NOISE = "openai_es.noise"  # pair i's noise in generation g (keys: generation, pair)
_SHAPINGS = {"centered_ranks": centered_ranks, "z_score": z_score}


def pair_noise(seed: Seed, generation: int, n_pairs: int, dim: int) -> np.ndarray:
    """(n_pairs, dim) unit Gaussian noise; row i from the ``openai_es.noise`` stream at
    ``(generation, i)`` (:mod:`essa.seeding`).

    >>> pair_noise(0, 3, 2, 4).shape
    (2, 4)
    """
    rows = (seeding.rng(seed, NOISE, generation, i) for i in range(n_pairs))
    return np.stack([row.standard_normal(dim) for row in rows])


def antithetic_population(mean: AdapterVector, sigma: float, noise: np.ndarray) -> Population:
    """(2 * n_pairs, D) population: row 2i = mean + sigma * noise[i], row 2i+1 = mean - sigma * noise[i]."""
    population = np.empty((2 * noise.shape[0], mean.size), dtype=np.float64)
    population[0::2] = mean + sigma * noise
    population[1::2] = mean - sigma * noise
    return population


def _check_options(
    step: str, lr: float, betas: tuple[float, float], momentum: float, l2coeff: float, shaping: str
) -> None:
    """Raise ValueError on option values the update cannot use."""
    if step not in ("adam", "sgd"):
        raise ValueError(f"step must be 'adam' or 'sgd', got {step!r}")
    if shaping not in _SHAPINGS:
        raise ValueError(f"shaping must be one of {sorted(_SHAPINGS)}, got {shaping!r}")
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be finite and > 0, got {lr!r}")
    if not all(0.0 <= beta < 1.0 for beta in (*betas, momentum)):
        raise ValueError("adam_beta1, adam_beta2 and sgd_momentum must lie in [0, 1)")
    if not (math.isfinite(l2coeff) and l2coeff >= 0):
        raise ValueError(f"l2coeff must be finite and >= 0, got {l2coeff!r}")


class OpenAIES(BestSoFar):
    """Seed-based antithetic OpenAI-ES with Adam or SGD; see the module docstring."""

    name = "openai_es"

    def __init__(
        self,
        dim: int,
        *,
        population_size: int,  # number of candidates; must be even (antithetic pairs)
        sigma0: float,  # noise scale, constant, relative to stds
        seed: int,  # noise of pair i in generation g: openai_es.noise at (g, i)
        stds: np.ndarray | None = None,  # (D,) per-coordinate noise and step scales
        x0: np.ndarray | None = None,  # (D,) initial mean; zeros = the SFT adapter in ESSA
        step: StepRule = "adam",  # step rule applied to -g + l2coeff * z
        lr: float = 0.01,  # Adam step size / SGD learning rate (starter humanoid: 0.01)
        adam_beta1: float = 0.9,
        adam_beta2: float = 0.999,
        adam_epsilon: float = 1e-8,
        sgd_momentum: float = 0.0,  # exponential average of gradients; 0 = plain SGD
        l2coeff: float = 0.0,  # weight decay towards zero (starter humanoid: 0.005)
        shaping: Shaping = "centered_ranks",
        enable_raise_on_all_failed: bool = False,  # raise instead of skipping all-NaN generations
    ) -> None:
        check_common_args(dim, population_size, sigma0, seed)
        if population_size % 2:
            raise ValueError(f"openai_es needs an even population_size, got {population_size}")
        _check_options(step, lr, (adam_beta1, adam_beta2), sgd_momentum, l2coeff, shaping)
        self._dim = dim
        self._population_size = population_size
        self._sigma = float(sigma0)
        self._seed = seed
        mean0 = np.zeros(dim) if x0 is None else as_vector(x0, dim, "x0")
        self._stds = np.ones(dim) if stds is None else as_vector(stds, dim, "stds", positive=True)
        self._enable_raise_on_all_failed = enable_raise_on_all_failed
        self._config: dict[str, Any] = {
            "dim": dim,
            "population_size": population_size,
            "sigma0": self._sigma,
            "seed": seed,
            "x0": mean0.tolist(),
            "stds": None if stds is None else self._stds.tolist(),
            "step": step,
            "lr": float(lr),
            "adam_beta1": float(adam_beta1),
            "adam_beta2": float(adam_beta2),
            "adam_epsilon": float(adam_epsilon),
            "sgd_momentum": float(sgd_momentum),
            "l2coeff": float(l2coeff),
            "shaping": shaping,
        }
        self._mean = mean0
        self._moment1 = np.zeros(dim)  # Adam m, or the SGD velocity
        self._moment2 = np.zeros(dim)  # Adam v (unused by SGD)
        self._t = 0  # number of steps applied (skipped generations excluded)
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
        return self._sigma

    @property
    def generation(self) -> int:
        return self._generation

    def _unit_noise(self) -> np.ndarray:
        """(P/2, D) unit noise of the current generation."""
        return pair_noise(self._seed, self._generation, self._population_size // 2, self._dim)

    def ask(self) -> Population:
        """(P, D) antithetic candidates; a pure function of (mean, seed, generation)."""
        if self._pending is None:
            self._pending = antithetic_population(
                self._mean, self._sigma, self._stds * self._unit_noise()
            )
        return self._pending.copy()

    def tell(self, population: Population, fitness: Fitness) -> dict[str, float]:
        """One step from the antithetic fitness differences; NaN = failed, ranked worst."""
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
        step_metrics = {"grad_norm": math.nan, "step_norm": 0.0}
        if all_failed:
            self._n_skipped += 1
        else:
            self._update_best(self._pending, fitness)
            step_metrics = self._step(fitness)
        self._generation += 1
        self._pending = None
        return {
            **fitness_metrics(fitness),
            **step_metrics,
            "sigma": self._sigma,
            "skipped": float(all_failed),
            "generation": float(self._generation),
        }

    def _step(self, fitness: Fitness) -> dict[str, float]:
        """Shape, estimate the gradient in z = x / stds, apply the step rule, update the mean."""
        shaped = _SHAPINGS[self._config["shaping"]](fitness)  # (P,)
        # (P/2,) @ (P/2, D) -> (D,): ascent direction, divided by the number of returns.
        grad_z = (shaped[0::2] - shaped[1::2]) @ self._unit_noise() / self._population_size
        loss_grad = -grad_z + self._config["l2coeff"] * (self._mean / self._stds)
        self._t += 1
        if self._config["step"] == "adam":
            step_z, self._moment1, self._moment2 = adam_step(
                loss_grad,
                self._moment1,
                self._moment2,
                self._t,
                lr=self._config["lr"],
                beta1=self._config["adam_beta1"],
                beta2=self._config["adam_beta2"],
                epsilon=self._config["adam_epsilon"],
            )
        else:
            step_z, self._moment1 = sgd_step(
                loss_grad,
                self._moment1,
                lr=self._config["lr"],
                momentum=self._config["sgd_momentum"],
            )
        step = self._stds * step_z  # (D,) back to x coordinates
        self._mean = self._mean + step
        return {
            "grad_norm": float(np.linalg.norm(grad_z)),
            "step_norm": float(np.linalg.norm(step)),
        }

    def state_dict(self) -> dict[str, Any]:
        """Mean, step-rule moments and counters as plain lists (float64 -> float is exact)."""
        return {
            "optimizer": self.name,
            "format": STATE_FORMAT,
            "config": dict(self._config),
            "generation": self._generation,
            "t": self._t,
            "n_skipped": self._n_skipped,
            "mean": self._mean.tolist(),
            "moment1": self._moment1.tolist(),
            "moment2": self._moment2.tolist(),
            **self._best_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a ``state_dict()`` of an optimizer built with the same arguments."""
        check_state_header(state, self.name, STATE_FORMAT)
        check_same_config(state["config"], self._config, self.name)
        self._generation = int(state["generation"])
        self._t = int(state["t"])
        self._n_skipped = int(state["n_skipped"])
        self._mean = as_vector(state["mean"], self._dim, "mean")
        self._moment1 = as_vector(state["moment1"], self._dim, "moment1")
        self._moment2 = as_vector(state["moment2"], self._dim, "moment2")
        self._load_best(state)
        self._pending = None

    def checksum(self) -> str:
        """sha256 of the canonical JSON state (floats in shortest round-trip form)."""
        return sha256_hex(canonical_json(self.state_dict()).encode())


@dataclass(frozen=True)
class OpenAIESOptions(EsOptions):
    """OpenAI-ES's own keys of the config's ``optimizer`` section."""

    lr: float = 0.1  # Adam step size / SGD learning rate
    step: StepRule = "adam"  # step rule applied to -g + l2coeff * z

    def check(self, population_size: int, *, layerwise: bool) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if population_size % 2:
            raise ValueError(
                "population_size: openai_es needs an even population (antithetic pairs)"
            )

    def pair_size(self) -> int:
        return 2  # every candidate has its mirror image


SPEC = EsOptimizerSpec(
    name=OpenAIES.name, factory=OpenAIES, options=OpenAIESOptions, seed_domains={NOISE: 102}
)
