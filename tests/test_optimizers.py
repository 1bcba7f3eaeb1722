"""Tests of essa.optimizers: import hygiene, shaping math, NaN handling, determinism, exact resume."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from essa.optimizers import (
    OPTIMIZERS,
    Optimizer,
    centered_ranks,
    fill_failed,
    make_optimizer,
    ranks_nan_worst,
    z_score,
)
from essa.optimizers.cma_es import resolve_variant
from essa.optimizers.openai_es import pair_noise

OPTIMIZER_DIR = Path(__file__).resolve().parents[1] / "essa" / "optimizers"
# Per-optimizer options for the smoke test; an optimizer missing here runs with its defaults.
# cma_es: sep-CMA at dim 2000 keeps the test fast (full covariance there costs seconds per eigh).
# snes: 16 candidates in D = 2000 (the papers take 4 + 3 ln D = 26) start with sigma0 = 0.5, far
# above the sphere's best step; the papers' eta_mu = 1 overshoots while sigma shrinks at
# eta_sigma ~ 0.05 per generation, so the smoke run takes a smaller mean step.
SMOKE_OPTIONS: dict[str, dict] = {
    "cma_es": {"sep_above_dim": 1000},
    "openai_es": {"lr": 0.05},
    "snes": {"eta_mu": 0.2},
}


def sphere(population: np.ndarray) -> np.ndarray:
    """(P, D) -> (P,) shifted sphere; the optimum is at 1, away from the zero start."""
    return np.sum((population - 1.0) ** 2, axis=-1)


def rastrigin(population: np.ndarray) -> np.ndarray:
    """(P, D) -> (P,) shifted Rastrigin; the zero start sits on a local maximum per coordinate."""
    shifted = population - 2.5
    return 10.0 * shifted.shape[-1] + np.sum(shifted**2 - 10.0 * np.cos(2 * np.pi * shifted), -1)


def make(name: str, dim: int = 12, seed: int = 3, **options) -> Optimizer:
    """Small optimizer for behaviour tests."""
    return make_optimizer(name, dim, population_size=8, sigma0=0.3, seed=seed, **options)


def run(opt: Optimizer, generations: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Tell -sphere with some random NaNs and one all-NaN generation; return the asks."""
    asks = []
    for generation in range(generations):
        population = opt.ask()
        fitness = -sphere(population)
        fitness[rng.random(fitness.size) < 0.2] = np.nan
        if generation == 2:
            fitness[:] = np.nan
        opt.tell(population, fitness)
        asks.append(population)
    return asks


# (a) import hygiene ------------------------------------------------------------------------


def test_import_does_not_pull_heavy_modules():
    code = "import sys, essa.optimizers; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = {name.split(".")[0] for name in out.stdout.split()}
    # cma is imported lazily: `import cma` pulls in matplotlib.
    assert not loaded & {"torch", "transformers", "mpi4py", "cma", "matplotlib"}


def test_optimizer_sources_import_only_numpy_stdlib_and_cma():
    allowed = set(sys.stdlib_module_names) | {"numpy", "cma", "__future__"}
    files = sorted(OPTIMIZER_DIR.glob("*.py"))
    assert len(files) >= 5
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                ok = name.split(".")[0] in allowed or name in ("essa.types", "essa.seeding")
                assert ok or name.startswith("essa.optimizers"), f"{path.name} imports {name}"


# registry ----------------------------------------------------------------------------------


def test_unknown_optimizer_lists_known_names():
    with pytest.raises(ValueError, match="cma_es.*openai_es"):
        make("nope")


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_registered_optimizers_satisfy_protocol(name):
    opt = make(name)
    assert isinstance(opt, Optimizer)
    population = opt.ask()
    assert population.shape == (8, 12) and population.dtype == np.float64
    assert np.array_equal(opt.ask(), population), "ask() must be idempotent until tell()"
    assert opt.mean.shape == (12,) and opt.generation == 0 and opt.sigma > 0


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_x0_and_relative_steps(name):
    x0, stds = np.linspace(-1.0, 1.0, 12), np.linspace(0.1, 3.0, 12)
    plain, scaled = make(name, x0=x0), make(name, x0=x0, stds=stds)
    assert np.array_equal(plain.mean, x0)
    # Before any update the covariance is the identity: stds scale each coordinate's offset.
    assert np.allclose(scaled.ask() - x0, stds * (plain.ask() - x0), rtol=1e-12, atol=0)


# (b) smoke ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("objective", [sphere, rastrigin], ids=["sphere", "rastrigin"])
@pytest.mark.parametrize("dim", [50, 2000])
def test_smoke_improves_mean(name, objective, dim):
    opt = make_optimizer(
        name, dim, population_size=16, sigma0=0.5, seed=0, **SMOKE_OPTIONS.get(name, {})
    )
    start = objective(opt.mean)
    for _ in range(60 if dim == 50 else 200):
        population = opt.ask()
        opt.tell(population, -objective(population))
    assert objective(opt.mean) < 0.7 * start
    assert opt.best_fitness > -start


def test_cma_variant_auto_switch():
    assert make("cma_es", dim=50).variant == "full"
    assert make("cma_es", dim=2001).variant == "sep"
    assert resolve_variant("auto", 2000, 2000) == "full"
    assert make("cma_es", dim=50, variant="sep").variant == "sep"


# (c) NaN handling --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_nan_ranked_worst_and_never_best(name):
    with_nan, with_low = make(name), make(name)
    population = with_nan.ask()
    fitness = -sphere(population)
    best_rows = np.argsort(fitness)[-3:]
    fitness[best_rows] = np.nan
    metrics = with_nan.tell(population, fitness)
    # NaN must act exactly like a value below every finite one.
    low = np.where(np.isnan(fitness), -1e12, fitness)
    with_low.tell(with_low.ask(), low)
    assert np.array_equal(with_nan.mean, with_low.mean)
    assert metrics["n_failed"] == 3 and metrics["fitness_best"] == np.nanmax(fitness)
    assert with_nan.best_fitness == np.nanmax(fitness)
    assert not any(np.array_equal(with_nan.best_x, population[row]) for row in best_rows)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_all_failed_generation_is_skipped_or_raises(name):
    opt = make(name)
    mean = opt.mean
    metrics = opt.tell(opt.ask(), np.full(8, np.nan))
    assert metrics["skipped"] == 1.0 and opt.generation == 1
    assert np.array_equal(opt.mean, mean) and np.isnan(opt.best_fitness)
    run(opt, 6, np.random.default_rng(0))
    assert np.isfinite(opt.best_fitness) and np.all(np.isfinite(opt.mean))

    strict = make(name, enable_raise_on_all_failed=True)
    with pytest.raises(RuntimeError, match="all 8 evaluations failed"):
        strict.tell(strict.ask(), np.full(8, np.nan))
    assert strict.generation == 0


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_tell_rejects_foreign_population_and_inf(name):
    opt = make(name)
    population = opt.ask()
    with pytest.raises(ValueError, match="exact population"):
        opt.tell(population + 1.0, np.zeros(8))
    with pytest.raises(ValueError, match="inf"):
        opt.tell(population, np.array([np.inf] + [0.0] * 7))
    with pytest.raises(ValueError, match="shape"):
        opt.tell(population, np.zeros(7))


# (d) determinism ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_same_seed_same_asks(name):
    first = run(make(name), 5, np.random.default_rng(1))
    second = run(make(name), 5, np.random.default_rng(1))
    other = run(make(name, seed=4), 5, np.random.default_rng(1))
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
    assert not np.array_equal(first[0], other[0])


def test_cma_leaves_global_numpy_rng_alone():
    # dim >= 300 selects TPA, whose consistency check draws from np.random.
    before = np.random.get_state()[1].copy()
    run(make("cma_es", dim=400, variant="sep"), 8, np.random.default_rng(0))
    assert np.array_equal(np.random.get_state()[1], before)


# (e) resume --------------------------------------------------------------------------------


def resume_cases() -> list[tuple[str, dict]]:
    """Every registered optimizer, plus cma_es with sep-CMA and TPA (dim >= 300)."""
    cases = [(name, {}) for name in sorted(OPTIMIZERS)]
    return [*cases, ("cma_es", {"dim": 400, "variant": "sep"})]


@pytest.mark.parametrize(("name", "options"), resume_cases())
def test_resume_from_json_is_exact(name, options):
    rng = np.random.default_rng(2)
    original = make(name, **options)
    run(original, 6, rng)
    pending = original.ask()  # a checkpoint is taken after tell; a pending ask must come back
    state = json.loads(json.dumps(original.state_dict(), allow_nan=False))

    resumed = make(name, **options)
    resumed.load_state_dict(state)
    assert resumed.checksum() == original.checksum()
    assert np.array_equal(resumed.ask(), pending)
    assert resumed.generation == original.generation == 6
    assert resumed.best_fitness == original.best_fitness
    after_original = run(original, 4, np.random.default_rng(5))
    after_resumed = run(resumed, 4, np.random.default_rng(5))
    assert all(np.array_equal(a, b) for a, b in zip(after_original, after_resumed, strict=True))
    assert np.array_equal(resumed.mean, original.mean) and resumed.sigma == original.sigma


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_resume_rejects_other_constructor_arguments(name):
    opt = make(name)
    run(opt, 2, np.random.default_rng(0))
    with pytest.raises(ValueError, match="seed"):
        make(name, seed=99).load_state_dict(opt.state_dict())


def test_cma_warns_when_replay_does_not_reproduce_saved_mean():
    opt = make("cma_es")
    run(opt, 3, np.random.default_rng(0))
    state = opt.state_dict()
    state["mean"][0] += 1.0  # what a different machine's eigendecomposition could cause
    with pytest.warns(RuntimeWarning, match="did not reproduce"):
        make("cma_es").load_state_dict(state)


# (f) shaping -------------------------------------------------------------------------------


def test_centered_ranks_hand_example():
    fitness = np.array([10.0, np.nan, -1.0, 3.0, np.nan])
    # ranks: the two NaNs tie at 0 and 1 (0.5 each), -1 -> 2, 3 -> 3, 10 -> 4; then / 4 - 0.5
    assert centered_ranks(fitness).tolist() == [0.5, -0.375, 0.0, 0.25, -0.375]
    assert ranks_nan_worst(np.array([2.0, 2.0, 1.0])).tolist() == [1.5, 1.5, 0.0]
    assert centered_ranks(np.array([np.nan])).tolist() == [0.0]


def _reference_ranks(values: np.ndarray) -> list[float]:
    """Average ranks by counting: below + (equal - 1) / 2, NaN equal to NaN and below numbers."""
    keys = np.where(np.isnan(values), -np.inf, values)
    return [float(np.sum(keys < k) + (np.sum(keys == k) - 1) / 2) for k in keys]


def test_ranks_average_ties_like_counting():
    rng = np.random.default_rng(0)
    for size in (1, 2, 5, 16, 33):
        values = rng.integers(0, 4, size).astype(np.float64)  # few levels: many ties
        values[rng.random(size) < 0.2] = np.nan
        assert ranks_nan_worst(values).tolist() == _reference_ranks(values), values
        order = rng.permutation(size)  # ranks follow the values, never the positions
        assert np.array_equal(ranks_nan_worst(values[order]), ranks_nan_worst(values)[order])
    assert ranks_nan_worst(np.array([-0.0, 0.0])).tolist() == [0.5, 0.5]


@pytest.mark.parametrize("shaping", [centered_ranks, z_score])
def test_constant_fitness_shapes_to_zero_and_ties_weigh_equally(shaping):
    assert shaping(np.full(6, 0.25)).tolist() == [0.0] * 6
    shaped = shaping(np.array([2.0, 0.0, 2.0, 1.0, np.nan, 2.0]))
    assert shaped[0] == shaped[2] == shaped[5] > shaped[3] > shaped[1] >= shaped[4]


def test_fill_failed_and_z_score():
    assert fill_failed(np.array([1e20, np.nan])).tolist()[1] < 1e20
    assert np.isnan(fill_failed(np.array([np.nan, np.nan]))).all()
    assert z_score(np.array([2.0, 2.0, np.nan])).tolist() == [0.0, 0.0, 0.0]
    assert z_score(np.array([0.0, 2.0])).tolist() == [-1.0, 1.0]


# (g) OpenAI-ES specifics -------------------------------------------------------------------


def test_openai_es_antithetic_pairs_from_seeds():
    stds = np.linspace(0.5, 2.0, 12)
    opt = make("openai_es", stds=stds)
    opt.tell(opt.ask(), np.arange(8.0))
    population, mean = opt.ask(), opt.mean
    noise = stds * pair_noise(3, 1, 4, 12)  # seed 3, generation 1, 4 pairs
    assert np.array_equal(population[0::2], mean + 0.3 * noise)
    assert np.array_equal(population[1::2], mean - 0.3 * noise)
    with pytest.raises(ValueError, match="even"):
        make_optimizer("openai_es", 4, population_size=7, sigma0=0.1, seed=0)


def test_openai_es_sgd_update_matches_hand_formula():
    stds = np.array([1.0, 2.0, 4.0])
    opt = make_optimizer(
        "openai_es", 3, population_size=2, sigma0=0.1, seed=7, stds=stds, step="sgd", lr=1.0
    )
    opt.tell(opt.ask(), np.array([1.0, 0.0]))
    # centered ranks (0.5, -0.5): g = (0.5 - -0.5) * eps / 2, mean += lr * stds * g
    eps = pair_noise(7, 0, 1, 3)[0]
    assert np.allclose(opt.mean, stds * eps / 2, rtol=1e-15, atol=0)


@pytest.mark.parametrize("step", ["adam", "sgd"])
@pytest.mark.parametrize("shaping", ["centered_ranks", "z_score"])
def test_openai_es_constant_fitness_is_a_zero_step(step, shaping):
    opt = make("openai_es", step=step, shaping=shaping, x0=np.linspace(-1, 1, 12))
    mean = opt.mean
    metrics = opt.tell(opt.ask(), np.full(8, 0.5))  # a flat 0/1-accuracy batch
    assert np.array_equal(opt.mean, mean)
    assert metrics["step_norm"] == 0.0 and metrics["grad_norm"] == 0.0


def test_openai_es_tied_pair_contributes_nothing():
    opt = make_optimizer("openai_es", 3, population_size=4, sigma0=0.1, seed=7, step="sgd", lr=1.0)
    opt.tell(opt.ask(), np.array([1.0, 1.0, 3.0, 0.0]))
    # ranks (1.5, 1.5, 3, 0) -> centered (0, 0, 0.5, -0.5): pair 0 is tied and adds no direction.
    eps = pair_noise(7, 0, 2, 3)
    assert np.allclose(opt.mean, (0.5 - -0.5) * eps[1] / 4, rtol=1e-15, atol=0)

    opt = make_optimizer("openai_es", 3, population_size=4, sigma0=0.1, seed=7, step="sgd", lr=1.0)
    opt.tell(opt.ask(), np.array([2.0, 0.0, 2.0, 1.0]))
    # Candidates 0 and 2 tie: both centered 2.5 / 3 - 0.5 = 1/3, whatever their positions.
    shaped = np.array([1 / 3, -0.5, 1 / 3, -1 / 6])
    expected = ((shaped[0] - shaped[1]) * eps[0] + (shaped[2] - shaped[3]) * eps[1]) / 4
    assert np.allclose(opt.mean, expected, rtol=1e-12, atol=0)


def test_cma_constant_fitness_leaves_the_distribution_alone():
    opt = make("cma_es")
    population, mean, sigma = opt.ask(), opt.mean, opt.sigma
    metrics = opt.tell(population, np.full(8, 0.5))
    assert metrics["skipped"] == 1.0 and opt.generation == 1
    assert np.array_equal(opt.mean, mean) and opt.sigma == sigma
    assert np.array_equal(opt.ask(), population)  # the same candidates, asked again
    assert opt.best_fitness == 0.5  # still a real evaluation: it counts for the best so far
    # One failure among equal values is a ranking (the failed one is worst): pycma is told.
    metrics = opt.tell(population, np.array([0.5] * 7 + [np.nan]))
    assert metrics["skipped"] == 0.0 and not np.array_equal(opt.mean, mean)
    resumed = make("cma_es")
    resumed.load_state_dict(json.loads(json.dumps(opt.state_dict())))
    assert resumed.checksum() == opt.checksum()


def test_adam_epsilon_damps_tiny_gradients():
    from essa.optimizers.steps import adam_step

    # First step: m = 0.1 g, sqrt(v) = sqrt(0.001) |g|; epsilon dominates for |g| << epsilon.
    grad = np.array([1e-10, -1e-10])
    step, _, _ = adam_step(grad, np.zeros(2), np.zeros(2), 1, lr=0.1, beta1=0.9, beta2=0.999,
                           epsilon=1e-8)  # fmt: skip
    assert np.all(np.sign(step) == -np.sign(grad))  # still a descent step ...
    assert np.all(np.abs(step) < 0.1 * 0.02)  # ... but damped far below lr * sign(grad)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_format_and_versions_are_recorded(name):
    """Checkpoint compatibility: the state format is 1 for every optimizer, and cma_es records
    the pycma version its replay depends on (a different one warns on load)."""
    opt = make(name)
    run(opt, 2, np.random.default_rng(0))
    state = opt.state_dict()
    assert state["format"] == 1 and state["optimizer"] == name
    if name == "cma_es":
        import cma

        assert state["cma_version"] == cma.__version__
        state["cma_version"] = "0.0.0"
        with pytest.warns(RuntimeWarning, match="saved with pycma 0.0.0"):
            make(name).load_state_dict(state)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_best_x_is_the_best_candidate_and_dim_is_checked(name):
    opt = make(name)
    population = opt.ask()
    fitness = -sphere(population)
    opt.tell(population, fitness)
    assert np.array_equal(opt.best_x, population[np.argmax(fitness)])
    for dim in (0, -3, True, 2.0):
        with pytest.raises(ValueError, match="dim"):
            make_optimizer(name, dim, population_size=8, sigma0=0.3, seed=0)


# (h) checksum ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_checksum_tracks_history(name):
    first, second, third = make(name), make(name), make(name)
    for opt, sign in ((first, -1.0), (second, -1.0), (third, 1.0)):
        population = opt.ask()
        opt.tell(population, sign * sphere(population))
    assert first.checksum() == second.checksum()
    assert first.checksum() != third.checksum()
    assert len(first.checksum()) == 64


def test_cma_es_mirrored_pairs_are_antithetic_and_resume_exactly() -> None:
    from essa.optimizers.cma_es import CMAES

    stds = np.linspace(0.5, 2.0, 6)
    opt = CMAES(6, population_size=8, sigma0=0.3, seed=4, stds=stds, mirrored=True)
    rng = np.random.default_rng(0)
    for _ in range(3):
        X = opt.ask()  # (8, 6): candidates 2i and 2i+1 mirror each other about the mean
        mean = np.asarray(opt.mean)
        np.testing.assert_allclose(X[0::2] + X[1::2], np.tile(2 * mean, (4, 1)), atol=1e-12)
        opt.tell(X, -np.sum(X**2, axis=1) + rng.normal(0, 0.01, 8))
    plain = CMAES(6, population_size=8, sigma0=0.3, seed=4, stds=stds)
    Y = plain.ask()
    assert not np.allclose(Y[0::2] + Y[1::2], 2 * np.asarray(plain.mean)[None, :])
    again = CMAES(6, population_size=8, sigma0=0.3, seed=4, stds=stds, mirrored=True)
    again.load_state_dict(opt.state_dict())
    np.testing.assert_array_equal(again.ask(), opt.ask())
    with pytest.raises(ValueError, match="even population"):
        CMAES(6, population_size=7, sigma0=0.3, seed=4, mirrored=True)


def test_cma_es_flat_reward_widens_sigma_by_hansens_factor_and_resumes_exactly() -> None:
    from essa.optimizers.cma_es import CMAES

    def build() -> CMAES:
        return CMAES(6, population_size=8, sigma0=0.3, seed=4, mirrored=True)

    opt, plain = build(), build()
    # D = 6, mu_eff of popsize 8: cs = (mu_eff + 2) / (D + mu_eff + 5), damps = 1 + cs here.
    mueff = float(opt._es.sp.weights.mueff)
    cs = (mueff + 2) / (6 + mueff + 5)
    factor = np.exp(0.2 + cs / (1 + 2 * max(0.0, np.sqrt((mueff - 1) / 7) - 1) + cs))
    assert opt.flat_factor() == pytest.approx(factor)
    rng = np.random.default_rng(1)
    for g in range(2):
        X, Y = opt.ask(), plain.ask()
        np.testing.assert_array_equal(X, Y)  # same state so far, except sigma
        fitness = -np.sum(X**2, axis=1) + rng.normal(0, 0.01, 8)
        m = opt.tell(X, fitness, flat=g == 1)
        plain.tell(Y, fitness)
        assert m["sigma_widened"] == float(g == 1)
        if g == 1:
            assert opt.sigma == pytest.approx(plain.sigma * factor)
    assert opt.state_dict()["widened"] == [1]
    again = build()
    again.load_state_dict(opt.state_dict())
    assert again.sigma == opt.sigma and again.checksum() == opt.checksum()
    np.testing.assert_array_equal(again.ask(), opt.ask())
    # A generation that ranks nothing is skipped, so it widens nothing either.
    before = opt.sigma
    assert opt.tell(opt.ask(), np.zeros(8), flat=True)["sigma_widened"] == 0.0
    assert opt.sigma == before
