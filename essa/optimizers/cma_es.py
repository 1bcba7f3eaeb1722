"""CMA-ES (Hansen & Ostermeier 2001) through pycma, maximising fitness; ESSA v3 §3.2.

Where this departs from the paper or from plain pycma use:

- Maximisation: pycma minimises, so ``tell`` passes ``-fitness``.
- Failed evaluations: NaN fitness is replaced by one value strictly below the worst finite fitness
  (``shaping.fill_failed``). CMA-ES only uses ranks, so this is exactly "NaN ranked worst".
  A generation where *every* candidate failed is skipped: pycma is not told, the generation
  counter still advances, and the next ``ask`` returns the same population again (pycma's TPA
  step-size rule forbids a second ``ask`` without a ``tell``; re-evaluating also suits transient
  failures). ``enable_raise_on_all_failed=True`` raises instead (and leaves the state untouched).
- Ties: pycma ranks by ``np.argsort``, so tied candidates get adjacent but *unequal*
  recombination weights in argsort order (deterministic, not by index); its ``tell`` has no way to
  give them their average weight. A generation whose fitness is constant (every candidate finite
  and equal: a flat 0/1-accuracy batch) carries no ranking at all, and pycma would still move the
  mean towards an arbitrary half of the population; it is skipped like an all-failed one (mean,
  covariance and sigma unchanged, the same population asked again, ``skipped`` = 1).
- Full covariance as in the paper up to ``sep_above_dim`` (default 2000); above it, or with
  ``variant="sep"``, diagonal sep-CMA (``CMA_diagonal=True``), whose cost is linear in D.
- Relative steps: ``stds`` become pycma's ``CMA_stds``, so the initial step of coordinate i is
  ``sigma0 * stds[i]`` (the SFT singular values in ESSA).
- pycma's defaults are kept otherwise: active covariance update (negative weights), TPA step-size
  adaptation instead of CSA for D >= 300, mirrored sampling only when popsize < 6; with
  ``mirrored=True`` every candidate pair is antithetic (``CMA_mirrors = popsize / 2``,
  unconditional mirroring, ``CMA_mirrormethod = 0``), as OpenAI-ES samples always are.
- Flat reward (``tell(..., flat=True)``): the caller says that the generation's primary reward
  tied the top 70% of the population, so any ranking came from a secondary term (ESSA's
  reference log-likelihood tie-breaker). After telling pycma, sigma is multiplied by
  ``exp(0.2 + cs / damps)``, Hansen's "escape flat fitness" rule (purecmaes.m, The CMA Evolution
  Strategy: A Tutorial, 2016); pycma 4 stops on flat fitness instead. cs and damps are CSA's
  defaults for (D, mu_eff) since TPA has none: at D ~ 2000 the factor is about 1.22. The
  generations widened are stored in the state and replayed on resume.
- No termination: every stopping criterion is disabled and ``stop()`` is never called (it would
  read a signals file from the working directory). The caller drives the loop by budget.
- Randomness: one dedicated ``np.random.Generator`` seeded from ``SeedSequence(seed)`` is passed as
  pycma's ``randn``; pycma's ``seed`` option is NaN so that pycma never seeds the global numpy RNG.
  pycma's TPA consistency check still draws from the global RNG (it only ever warns), so every
  pycma call runs with the global RNG state saved and restored.

Cost: full covariance does an O(D^3) eigendecomposition every few generations in multithreaded
BLAS. With several MPI ranks per node, limit BLAS to one thread per rank (OPENBLAS_NUM_THREADS=1):
oversubscribed BLAS threads make small ``eigh`` calls orders of magnitude slower.

Checkpoints without pickle: pycma's state (C, paths, lazy eigendecomposition) is not plain data, so
``state_dict`` stores the constructor arguments plus the history of told fitness arrays, and
``load_state_dict`` rebuilds pycma and replays ask/tell over that history: O(generations) ask/tell
calls, about as long as the optimizer's own share of the run so far (tens of ms per generation at
D ~ 450, popsize 96, full covariance, one core), plus ~2 kB of JSON per generation. The replay is
bit-identical on the same machine and library versions; ``load_state_dict`` warns if the replayed
mean or sigma differ from the stored ones. A checkpoint reflects the state after the last ``tell``:
a population asked but not yet told is not saved, and the resumed optimizer's next ``ask`` returns
exactly that population again.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator, Mapping
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
    fitness_from_json,
    fitness_metrics,
    fitness_to_json,
    sha256_hex,
)
from essa.optimizers.shaping import fill_failed
from essa.types import AdapterVector, Fitness, Population

Variant = Literal["auto", "full", "sep"]
STATE_FORMAT = 1
# The candidates' stream (keys: none). Tag 0 makes SeedSequence([seed, 0]), which numpy pads to
# the bare SeedSequence(seed) CMA-ES drew from before essa.seeding: the demo's adapter bytes and
# archived runs rest on it.
SAMPLES = "cma_es.samples"

# Every pycma stopping criterion off: quantised accuracy plateaus, so runs are budget-driven.
_NO_TERMINATION: dict[str, Any] = {
    "maxiter": math.inf,
    "maxfevals": math.inf,
    "timeout": math.inf,
    "tolfun": 0.0,
    "tolfunhist": 0.0,
    "tolfunrel": 0.0,
    "tolflatfitness": math.inf,
    "tolstagnation": 0,  # 0 disables the check entirely
    "tolxstagnation": False,
    "tolx": 0.0,
    "tolfacupx": math.inf,
    "tolupsigma": math.inf,
    "tolconditioncov": math.inf,
}
_SILENT: dict[str, Any] = {
    "verbose": -9,
    "verb_log": 0,
    "verb_disp": 0,
    "verb_plot": 0,
    "verb_time": False,
    "signals_filename": "",  # "" = never look for a signals file
}


@contextlib.contextmanager
def _global_numpy_rng_preserved() -> Iterator[None]:
    """Restore numpy's global RNG state afterwards, so pycma leaves other code's streams alone."""
    saved = np.random.get_state()
    try:
        yield
    finally:
        np.random.set_state(saved)


def ranks_nothing(fitness: Fitness) -> bool:
    """True when no candidate ranks above another: every one failed, or all are finite and equal.

    >>> ranks_nothing(np.array([1.0, 1.0])), ranks_nothing(np.array([1.0, np.nan]))
    (True, False)
    """
    finite = fitness[~np.isnan(fitness)]
    return bool(finite.size == 0 or (finite.size == fitness.size and finite.min() == finite.max()))


def resolve_variant(variant: Variant, dim: int, sep_above_dim: int) -> Literal["full", "sep"]:
    """``"auto"`` means full covariance up to ``sep_above_dim`` and sep-CMA above it."""
    if variant == "auto":
        return "sep" if dim > sep_above_dim else "full"
    if variant not in ("full", "sep"):
        raise ValueError(f"variant must be 'auto', 'full' or 'sep', got {variant!r}")
    return variant


class CMAES(BestSoFar):
    """CMA-ES over a (D,) vector with replicated, deterministic state; see the module docstring."""

    name = "cma_es"

    def __init__(
        self,
        dim: int,
        *,
        population_size: int,  # lambda; ESSA default 96
        sigma0: float,  # initial global step, relative to stds
        seed: int,  # the whole sample stream derives from SeedSequence(seed)
        stds: np.ndarray | None = None,  # (D,) per-coordinate step scales (CMA_stds)
        x0: np.ndarray | None = None,  # (D,) initial mean; zeros = the SFT adapter in ESSA
        variant: Variant = "auto",  # full covariance, sep-CMA, or chosen by sep_above_dim
        sep_above_dim: int = 2000,  # auto switches to sep-CMA when dim > this
        enable_raise_on_all_failed: bool = False,  # raise instead of skipping all-NaN generations
        mirrored: bool = False,  # antithetic pairs m +- sigma z (pycma CMA_mirrors, method 0)
    ) -> None:
        check_common_args(dim, population_size, sigma0, seed)
        if mirrored and population_size % 2:
            raise ValueError(f"mirrored sampling needs an even population, got {population_size}")
        self._dim = dim
        self._population_size = population_size
        self._x0 = np.zeros(dim) if x0 is None else as_vector(x0, dim, "x0")
        self._stds = None if stds is None else as_vector(stds, dim, "stds", positive=True)
        self._variant = resolve_variant(variant, dim, sep_above_dim)
        self._enable_raise_on_all_failed = enable_raise_on_all_failed
        # Plain data that fixes the trajectory: compared on load, hashed by checksum().
        self._config: dict[str, Any] = {
            "dim": dim,
            "population_size": population_size,
            "sigma0": float(sigma0),
            "seed": seed,
            "variant": self._variant,
            "x0": self._x0.tolist(),
            "stds": None if self._stds is None else self._stds.tolist(),
        }
        if mirrored:  # only when on, so that checkpoints written before the option still load
            self._config["mirrored"] = True
        self._reset()

    def _reset(self) -> None:
        """Fresh pycma object and bookkeeping, as right after construction."""
        self._es = self._new_pycma()
        self._history: list[list[float | None]] = []
        self._pending: list[np.ndarray] | None = None  # pycma's own arrays from the last ask
        self._pending_population: Population | None = None  # (P, D) stacked copy
        self._n_skipped = 0
        self._widened: list[int] = []  # generations after which sigma escaped a flat reward

    def _new_pycma(self) -> Any:
        """Build the pycma strategy from the constructor arguments alone."""
        # Imported here: `import cma` pulls in matplotlib (~0.6 s), and `import essa.optimizers`
        # must stay light.
        with warnings.catch_warnings():
            # pycma warns at import when matplotlib (its plotting only) is missing; we never plot.
            warnings.filterwarnings("ignore", message="Could not import matplotlib.pyplot")
            import cma

        rng = seeding.rng(self._config["seed"], SAMPLES)

        def randn(*shape: int) -> np.ndarray:
            return rng.standard_normal(shape)

        options: dict[str, Any] = {
            "popsize": self._population_size,
            "CMA_diagonal": self._variant == "sep",
            "randn": randn,
            "seed": math.nan,  # NaN: pycma skips np.random.seed(...) entirely
            **_NO_TERMINATION,
            **_SILENT,
        }
        if self._stds is not None:
            options["CMA_stds"] = self._stds.copy()
        if self._config.get("mirrored"):
            # Every other candidate is the mirror image of the one before it, 2m - x: the pair
            # shares its noise, so their fitness difference measures the direction, not luck.
            options.update(CMA_mirrors=self._population_size // 2, CMA_mirrormethod=0)
        with _global_numpy_rng_preserved():
            return cma.CMAEvolutionStrategy(self._x0.copy(), self._config["sigma0"], options)

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def population_size(self) -> int:
        return self._population_size

    @property
    def variant(self) -> Literal["full", "sep"]:
        """The covariance model actually used ("auto" resolved)."""
        return self._variant

    @property
    def mean(self) -> AdapterVector:
        return np.array(self._es.mean, dtype=np.float64)

    @property
    def sigma(self) -> float:
        return float(self._es.sigma)

    @property
    def generation(self) -> int:
        return len(self._history)

    def ask(self) -> Population:
        """(P, D) candidates; the same population until ``tell``."""
        return self._ensure_pending().copy()

    def _ensure_pending(self) -> Population:
        """Draw the generation's population from pycma once; return our (P, D) stack of it."""
        if self._pending is None or self._pending_population is None:
            with _global_numpy_rng_preserved():
                self._pending = self._es.ask()
            self._pending_population = np.array(self._pending, dtype=np.float64)
        return self._pending_population

    def tell(
        self, population: Population, fitness: Fitness, *, flat: bool = False
    ) -> dict[str, float]:
        """Update from the last asked population; NaN fitness = failed, ranked worst.

        ``flat``: the primary reward ranked nothing this generation (module docstring); sigma
        then grows by :meth:`flat_factor` after the update.
        """
        fitness = as_fitness(fitness, self._population_size)
        check_population(population, self._ensure_pending())
        all_failed = bool(np.all(np.isnan(fitness)))
        if all_failed and self._enable_raise_on_all_failed:
            raise RuntimeError(
                f"all {fitness.size} evaluations failed (NaN) in generation {self.generation}"
            )
        self._apply(fitness)
        skipped = ranks_nothing(fitness)
        widen = flat and not skipped  # a skipped generation moved nothing
        if widen:
            self._widen(self.generation)
        self._history.append(fitness_to_json(fitness))
        return {
            **fitness_metrics(fitness),
            "sigma": self.sigma,
            "skipped": float(skipped),
            "sigma_widened": float(widen),
            "generation": float(self.generation),
        }

    def flat_factor(self) -> float:
        """exp(0.2 + cs / damps) with CSA's default cs and damps for this (D, mu_eff)."""
        n, mueff = self._dim, float(self._es.sp.weights.mueff)
        cs = (mueff + 2) / (n + mueff + 5)
        damps = 1 + 2 * max(0.0, math.sqrt((mueff - 1) / (n + 1)) - 1) + cs
        return math.exp(0.2 + cs / damps)

    def _widen(self, generation: int) -> None:
        self._es.sigma *= self.flat_factor()
        self._widened.append(generation)

    def _apply(self, fitness: Fitness) -> None:
        """Tell pycma and clear the pending population, or skip a generation that ranks nothing."""
        assert self._pending is not None and self._pending_population is not None
        if ranks_nothing(fitness):
            # Keep the population pending: pycma's TPA refuses a second ask() without a tell().
            if not np.all(np.isnan(fitness)):
                self._update_best(self._pending_population, fitness)
            self._n_skipped += 1
            return
        self._update_best(self._pending_population, fitness)
        with _global_numpy_rng_preserved():
            self._es.tell(self._pending, (-fill_failed(fitness)).tolist())
        self._pending = None
        self._pending_population = None

    def state_dict(self) -> dict[str, Any]:
        """Constructor arguments + told fitness history; mean and sigma only to verify a replay."""
        return {
            "optimizer": self.name,
            "format": STATE_FORMAT,
            "config": dict(self._config),
            "history": [list(fitness) for fitness in self._history],
            "generation": self.generation,
            "n_skipped": self._n_skipped,
            **({"widened": list(self._widened)} if self._widened else {}),
            "mean": self.mean.tolist(),
            "sigma": self.sigma,
            "cma_version": _cma_version(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Rebuild pycma and replay every ask/tell of ``state["history"]`` (O(generations))."""
        check_state_header(state, self.name, STATE_FORMAT)
        check_same_config(state["config"], self._config, self.name)
        if state.get("cma_version") != _cma_version():
            warnings.warn(
                f"cma_es state saved with pycma {state.get('cma_version')}, replaying with "
                f"{_cma_version()}: the resumed trajectory may differ",
                RuntimeWarning,
                stacklevel=2,
            )
        self._reset()
        widened = set(state.get("widened", []))
        for entry in state["history"]:
            self._ensure_pending()
            fitness = fitness_from_json(entry)
            if fitness.shape != (self._population_size,):
                # A skipped (tied) generation never reaches pycma, which would catch this.
                raise ValueError(
                    f"history entry of {fitness.size} values for a population of "
                    f"{self._population_size}"
                )
            self._apply(fitness)
            if len(self._history) in widened:
                self._widen(len(self._history))
            self._history.append(list(entry))
        self._warn_if_replay_differs(state)

    def _warn_if_replay_differs(self, state: Mapping[str, Any]) -> None:
        """Different BLAS/CPU can change eigendecompositions in the last bits; say so."""
        same_mean = np.array_equal(self.mean, np.asarray(state["mean"], dtype=np.float64))
        if not (same_mean and self.sigma == state["sigma"]):
            warnings.warn(
                "cma_es replay did not reproduce the saved mean/sigma bit for bit "
                "(different machine or library versions?); continuing from the replayed state",
                RuntimeWarning,
                stacklevel=3,
            )

    def checksum(self) -> str:
        """sha256 over the state dict, pycma's numeric internals and the next population.

        Draws the next population first if it is not pending yet: pycma updates its
        eigendecomposition lazily inside ``ask``, so hashing before and after an ask would differ.
        ``ask`` is idempotent, so this changes nothing the caller can observe.
        """
        arrays = [self._ensure_pending(), self._es.mean, np.array([self._es.sigma]), self._es.pc]
        arrays += [np.asarray(self._es.sigma_vec.scaling), np.asarray(self._es.dC)]
        for owner, attribute in ((self._es.adapt_sigma, "ps"), (self._es.sm, "C")):
            if hasattr(owner, attribute):
                arrays.append(np.asarray(getattr(owner, attribute)))
        chunks = [np.ascontiguousarray(a, dtype=np.float64).tobytes() for a in arrays]
        return sha256_hex(canonical_json(self.state_dict()).encode(), *chunks)


def _cma_version() -> str:
    import cma

    return str(cma.__version__)


@dataclass(frozen=True)
class CMAESOptions(EsOptions):
    """CMA-ES's own keys of the config's ``optimizer`` section."""

    variant: Variant = "auto"  # covariance: full, sep (diagonal), or chosen by sep_above_dim
    sep_above_dim: int = 2000  # auto: diagonal covariance above this dimension
    mirrored: bool = False  # antithetic candidate pairs m +- sigma z
    # When the task reward ties the top 70% of the population (the reference tie-breaker alone
    # ranks them), multiply sigma by exp(0.2 + cs/damps), about 1.22: Hansen's escape from flat
    # fitness, so candidates that all answer alike are pushed apart until the reward ranks.
    escape_flat_reward: bool = False

    def check(self, population_size: int, *, layerwise: bool) -> None:
        if self.sep_above_dim < 0:
            raise ValueError(f"sep_above_dim: must be >= 0, got {self.sep_above_dim}")
        if self.escape_flat_reward and layerwise:
            raise ValueError(
                "escape_flat_reward: applies to cma_es without layerwise (it widens CMA-ES's "
                "step size)"
            )
        if self.mirrored and population_size % 2:
            raise ValueError("population_size: mirrored pairs need an even population")

    def pair_size(self) -> int:
        return 2 if self.mirrored else 1

    def kwargs(self) -> dict[str, Any]:
        # escape_flat_reward is a tell() argument per generation (tell_kwargs), not a constructor's.
        return {
            "variant": self.variant,
            "sep_above_dim": self.sep_above_dim,
            "mirrored": self.mirrored,
        }

    def tell_kwargs(self, *, reward_flat: bool) -> dict[str, Any]:
        return {"flat": True} if self.escape_flat_reward and reward_flat else {}


SPEC = EsOptimizerSpec(
    name=CMAES.name, factory=CMAES, options=CMAESOptions, seed_domains={SAMPLES: 0}
)
