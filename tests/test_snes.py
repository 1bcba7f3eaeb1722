"""SNES (essa/optimizers/snes.py): the papers' update, NaN handling, exact resume, and the
optimizer reached through the config and ``essa train``.

The Protocol-wide checks (idempotent ask, x0 and stds, same seed same asks, foreign population
and inf refused, state format) run for every registered optimizer in tests/test_optimizers.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from essa import seeding
from essa.config import ConfigError, load_config
from essa.optimizers import make_optimizer
from essa.optimizers.snes import SNES, default_eta_sigma, rank_utilities
from tests.test_train_e2e import SMALL, essa, sets


def sphere_fitness(population: np.ndarray) -> np.ndarray:
    """(P, D) -> (P,) -||x - 1||^2: maximised at 1, away from the zero start."""
    return -np.sum((population - 1.0) ** 2, axis=-1)


def snes(dim: int = 6, population_size: int = 8, seed: int = 3, **options: float) -> SNES:
    opt = make_optimizer(
        "snes", dim, population_size=population_size, sigma0=0.5, seed=seed, **options
    )
    assert isinstance(opt, SNES)
    return opt


def test_solves_the_sphere() -> None:
    """The papers' defaults (eta_mu = 1, eta_sigma = (3 + ln D) / (5 sqrt D), lambda = 4 +
    3 ln D = 10 at D = 10) reach the optimum, and sigma shrinks as the mean closes in."""
    opt = make_optimizer("snes", 10, population_size=10, sigma0=1.0, seed=0)
    for _ in range(300):
        population = opt.ask()
        opt.tell(population, sphere_fitness(population))
    assert np.abs(opt.mean - 1.0).max() < 1e-5
    assert opt.sigma < 1e-5
    assert opt.best_fitness > -1e-9


def test_utilities_follow_the_papers_formula() -> None:
    fitness = np.array([0.3, -2.0, 5.0, 1.0, 0.0, 4.0])  # ranks (1 = best): 4, 6, 1, 3, 5, 2
    n = fitness.size
    raw = [max(0.0, math.log(n / 2 + 1) - math.log(k)) for k in range(1, n + 1)]
    by_rank = [r / sum(raw) - 1 / n for r in raw]
    expected = [by_rank[k - 1] for k in (4, 6, 1, 3, 5, 2)]
    utilities = rank_utilities(fitness)
    assert np.allclose(utilities, expected, rtol=0, atol=1e-15)
    assert abs(utilities.sum()) < 1e-15
    # Ties share the mean of the utilities their ranks span; constant fitness is exactly zero.
    tied = rank_utilities(np.array([0.3, -2.0, 5.0, 5.0, 0.0, 4.0]))
    assert tied[2] == tied[3] == pytest.approx((by_rank[0] + by_rank[1]) / 2, abs=1e-15)
    assert rank_utilities(np.full(5, 0.5)).tolist() == [0.0] * 5


def test_one_step_is_the_natural_gradient_update() -> None:
    opt = snes(eta_mu=0.7, eta_sigma=0.3)
    population = opt.ask()
    fitness = sphere_fitness(population)
    opt.tell(population, fitness)
    draws = seeding.rng(3, "snes.samples", 0).standard_normal((8, 6))  # s_k of generation 0
    assert np.allclose(population, 0.5 * draws, rtol=0, atol=1e-15)
    u = rank_utilities(fitness)
    mean = 0.7 * 0.5 * (u @ draws)
    sigmas = 0.5 * np.exp(0.5 * 0.3 * (u @ (draws**2 - 1.0)))
    assert np.allclose(opt.mean, mean, rtol=1e-14, atol=0)
    assert np.allclose(opt.sigmas, sigmas, rtol=1e-14, atol=0)
    assert opt.sigma == pytest.approx(float(np.exp(np.log(sigmas / 1.0).mean())), rel=1e-14)


def test_default_eta_sigma_and_relative_steps() -> None:
    assert snes(dim=100).state_dict()["config"]["eta_sigma"] == default_eta_sigma(100)
    assert default_eta_sigma(100) == pytest.approx((3 + math.log(100)) / 50)
    stds = np.linspace(0.5, 2.0, 6)
    opt = make_optimizer("snes", 6, population_size=8, sigma0=0.5, seed=3, stds=stds)
    assert isinstance(opt, SNES)
    assert np.allclose(opt.sigmas, 0.5 * stds) and opt.sigma == pytest.approx(0.5)


def test_nan_is_ranked_worst_and_all_failed_generations_are_skipped() -> None:
    opt = snes()
    population = opt.ask()
    fitness = sphere_fitness(population)
    best = int(np.argmax(fitness))
    fitness[best] = np.nan
    utilities = rank_utilities(fitness)
    assert utilities[best] == utilities.min()
    metrics = opt.tell(population, fitness)
    assert metrics["n_failed"] == 1.0 and not np.array_equal(opt.best_x, population[best])

    mean, sigmas = opt.mean, opt.sigmas
    skipped = opt.ask()
    metrics = opt.tell(skipped, np.full(8, np.nan))
    assert metrics["skipped"] == 1.0 and opt.generation == 2
    assert np.array_equal(opt.mean, mean) and np.array_equal(opt.sigmas, sigmas)
    assert not np.array_equal(opt.ask(), skipped)  # the next generation draws new noise

    rng = np.random.default_rng(0)  # a fifth of the evaluations failing still converges
    for _ in range(200):
        population = opt.ask()
        fitness = sphere_fitness(population)
        fitness[rng.random(8) < 0.2] = np.nan
        opt.tell(population, fitness)
    assert np.abs(opt.mean - 1.0).max() < 1e-2


def test_checkpoint_round_trip_draws_what_the_uninterrupted_run_draws() -> None:
    def generations(opt: SNES, n: int) -> list[np.ndarray]:
        asks = []
        for g in range(opt.generation, opt.generation + n):  # failures at fixed generations
            population = opt.ask()
            fitness = sphere_fitness(population)
            fitness[g % 8] = np.nan if g % 3 == 0 else fitness[g % 8]
            opt.tell(population, fitness)
            asks.append(population)
        return asks

    uninterrupted = snes()
    expected = generations(uninterrupted, 10)
    first = snes()
    asks = generations(first, 4)
    state = json.loads(json.dumps(first.state_dict(), allow_nan=False))  # a JSON checkpoint
    resumed = snes()
    resumed.load_state_dict(state)
    assert resumed.checksum() == first.checksum()
    asks += generations(resumed, 6)
    assert all(np.array_equal(a, b) for a, b in zip(asks, expected, strict=True))
    assert resumed.checksum() == uninterrupted.checksum()
    assert np.array_equal(resumed.sigmas, uninterrupted.sigmas)
    with pytest.raises(ValueError, match="eta_mu"):
        snes(eta_mu=0.5).load_state_dict(state)


def test_config_selects_snes_and_checks_its_keys(tmp_path: Path) -> None:
    path = tmp_path / "snes.yaml"
    path.write_text("optimizer:\n  name: snes\n  population_size: 6\n  eta_sigma: 0.2\n")
    o = load_config(path).optimizer
    assert (o.name, o.options.kwargs()) == ("snes", {"eta_mu": 1.0, "eta_sigma": 0.2})
    assert o.options.pair_size() == 1  # an odd population is fine: no antithetic pairs
    with pytest.raises(ConfigError, match=r":2: optimizer.eta_mu: must be > 0, got 0.0"):
        path.write_text("optimizer:\n  eta_mu: 0\n  name: snes\n")
        load_config(path)


@pytest.mark.slow
def test_tiny_demo_training_with_snes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = sets(*SMALL, "optimizer.name=snes", "run.generations=3", "data.val_size=0")
    proc = essa("train", "--run-dir", str(run_dir), *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((run_dir / "checkpoint.json").read_text())["optimizer"]
    state = state.get("inner", state)  # held zero singular values wrap it in a Subspace
    assert (state["optimizer"], state["generation"]) == ("snes", 3)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary and (run_dir / "adapter" / "adapter_model.safetensors").is_file()
