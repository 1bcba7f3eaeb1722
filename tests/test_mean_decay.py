"""optimizer.drift_budget.decay: the mean moves back toward its start after every tell, the same
wrapper for every registered ES optimizer (essa.optimizers.decay)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from essa.config import ConfigError, load_config
from essa.optimizers import OPTIMIZERS, EsOptimizerSpec, Optimizer, make_optimizer
from essa.optimizers.decay import MeanDecay, with_decay
from essa.optimizers.layerwise import LayerwiseES
from tests import test_architecture
from tests.test_optimizers import make, run, sphere

# test_architecture's toy ES, registered through the public registry and taken out after.
hill = test_architecture.hill

DIM = 12
ETA = 0.1


def start(dim: int = DIM) -> np.ndarray:
    """(D,) a start away from zero, as the scaled start is."""
    return np.linspace(-0.5, 0.7, dim)


def stds(dim: int = DIM) -> np.ndarray:
    return np.linspace(0.5, 2.0, dim)


def build(name: str, decay: float, seed: int = 3) -> Optimizer:
    """``name`` started at :func:`start` with relative steps; wrapped when ``decay`` is given
    (MeanDecay even at 0, so that the wrapper's own arithmetic is what is tested)."""
    if name == "layerwise":
        inner: Optimizer = LayerwiseES(
            DIM, layer_indices=[range(0, 4), range(4, 8), range(8, 12)], active_layers=2,
            interval=2, base="cma_es", population_size=8, sigma0=0.3, seed=seed, stds=stds(),
            x0=start(),
        )  # fmt: skip
    else:
        inner = make(name, DIM, seed, x0=start(), stds=stds())
    return MeanDecay(inner, decay, start())


CASES = [*sorted(OPTIMIZERS), "layerwise"]


@pytest.mark.parametrize("name", CASES)
def test_one_tell_decays_the_mean_the_optimizer_reaches(name: str) -> None:
    """From the same state (the start, then a state three generations in), one tell with
    decay eta ends at x0 + (1 - eta)(m' - x0), m' the mean the same tell reaches with eta = 0."""
    decayed, plain = build(name, ETA), build(name, 0.0)
    x0 = start()
    for generation in range(4):
        if generation:  # the same state, mid-run: the decayed state loaded at eta = 0
            state = json.loads(json.dumps(decayed.state_dict()))
            state["config"]["decay"] = 0.0
            plain = build(name, 0.0)
            plain.load_state_dict(state)
        population = decayed.ask()
        assert np.array_equal(population, plain.ask())
        fitness = -sphere(population)
        metrics = decayed.tell(population, fitness)
        plain.tell(population, fitness)
        want = x0 + (1 - ETA) * (plain.mean - x0)
        np.testing.assert_allclose(decayed.mean, want, rtol=1e-12, atol=1e-12)
        assert not np.allclose(decayed.mean, plain.mean)  # it did move
        assert metrics["decay_step_norm"] == pytest.approx(ETA * np.linalg.norm(plain.mean - x0))
        assert decayed.sigma == plain.sigma  # the optimizer's own update is untouched


@pytest.mark.parametrize("name", CASES)
def test_zero_decay_is_the_optimizer_bit_for_bit(name: str) -> None:
    """eta = 0: with_decay returns the optimizer itself, and even the wrapper at 0 asks the
    same candidates and reaches the same means, bit for bit."""
    plain = build(name, 0.0).inner  # type: ignore[attr-defined]
    assert with_decay(plain, 0.0, start()) is plain
    reference, wrapped = build(name, 0.0).inner, build(name, 0.0)  # type: ignore[attr-defined]
    asks = run(reference, 6, np.random.default_rng(1))
    wrapped_asks = run(wrapped, 6, np.random.default_rng(1))
    assert all(np.array_equal(a, b) for a, b in zip(asks, wrapped_asks, strict=True))
    assert np.array_equal(wrapped.mean, reference.mean)
    assert wrapped.best_fitness == reference.best_fitness


@pytest.mark.parametrize("name", CASES)
def test_resume_with_decay_is_exact(name: str) -> None:
    original = build(name, ETA)
    run(original, 5, np.random.default_rng(2))
    pending = original.ask()
    state = json.loads(json.dumps(original.state_dict(), allow_nan=False))
    resumed = build(name, ETA)
    resumed.load_state_dict(state)
    assert resumed.checksum() == original.checksum()
    assert np.array_equal(resumed.ask(), pending)
    after_original = run(original, 4, np.random.default_rng(5))
    after_resumed = run(resumed, 4, np.random.default_rng(5))
    assert all(np.array_equal(a, b) for a, b in zip(after_original, after_resumed, strict=True))
    assert np.array_equal(resumed.mean, original.mean)
    assert resumed.checksum() == original.checksum()
    with pytest.raises(ValueError, match="decay"):  # another eta does not resume it
        build(name, 0.2).load_state_dict(state)


def test_decay_pulls_a_stalled_search_home() -> None:
    """A generation that ranks nothing (CMA-ES skips it) still decays: after n such
    generations the mean's distance to x0 is (1 - eta)^n of what it was."""
    opt = build("cma_es", ETA)
    population = opt.ask()
    opt.tell(population, -sphere(population))
    gap = opt.mean - start()
    for _ in range(3):
        population = opt.ask()
        metrics = opt.tell(population, np.zeros(len(population)))  # flat: CMA-ES skips it
        assert metrics["skipped"] == 1.0
    np.testing.assert_allclose(opt.mean - start(), (1 - ETA) ** 3 * gap, rtol=1e-12)


def test_best_is_kept_in_the_searchs_coordinates() -> None:
    opt = build("openai_es", 0.5)
    for _ in range(3):
        population = opt.ask()
        fitness = -sphere(population)
        opt.tell(population, fitness)
        if fitness.max() == opt.best_fitness:
            assert np.array_equal(opt.best_x, population[int(np.argmax(fitness))])


def test_config_key_is_checked() -> None:
    assert load_config(None, []).optimizer.drift_budget.decay == 0.0
    cfg = load_config(None, ["optimizer.drift_budget.decay=0.05"])
    assert cfg.optimizer.drift_budget.decay == 0.05
    for bad in ("1", "1.5", "-0.1"):
        # the same one line as the section's other keys: the --set, then the key and the range
        with pytest.raises(ConfigError, match=r"drift_budget.decay: must be in \[0, 1\), got"):
            load_config(None, [f"optimizer.drift_budget.decay={bad}"])


# ------------------------------------------------------------ an optimizer registered outside essa


def test_a_toy_optimizer_gets_the_decay_with_no_code_of_its_own(hill: EsOptimizerSpec) -> None:
    """The toy's mean jumps to its best candidate; decayed, it lands (1 - eta) of the way."""
    opt = with_decay(make_optimizer(hill.name, DIM, population_size=6, sigma0=0.3, seed=0,
                                    x0=start()), ETA, start())  # fmt: skip
    for _ in range(3):
        population = opt.ask()
        fitness = -sphere(population)
        opt.tell(population, fitness)
        best = population[int(np.argmax(fitness))]
        np.testing.assert_allclose(opt.mean, start() + (1 - ETA) * (best - start()), rtol=1e-12)


@pytest.mark.slow
def test_a_toy_optimizer_searches_with_decay_through_essa_train(
    hill: EsOptimizerSpec, tmp_path: Path, tiny_model_dir: Path
) -> None:
    from essa.recipes import essa_es

    small = [
        f"model.name_or_path={tiny_model_dir}",
        "sft.steps=10",
        "sft.lr=0.01",
        "sft.batch_size=100",
        "data.sft_size=16",
        "data.batch_size=4",
        "data.test_size=8",
        "data.val_size=0",
        "optimizer.population_size=4",
        "optimizer.sigma0=3.0",
        "evaluation.every=0",
        "evaluation.use_scale_baseline=false",
        "generation.max_new_tokens=8",
        "reward.name=mpi_helpers:char_variety",
        "run.show_progress=false",
        "run.generations=2",
        f"optimizer.name={hill.name}",
        "optimizer.drift_budget.decay=0.5",
    ]
    essa_es.run(load_config(None, small), tmp_path)
    state = json.loads((tmp_path / "checkpoint.json").read_text())["optimizer"]
    assert (state["optimizer"], state["config"]["decay"]) == ("mean_decay", 0.5)
    assert np.any(np.asarray(state["offset"]) != 0.0)
    inner = state["inner"].get("inner", state["inner"])  # a Subspace when values are held
    assert (inner["optimizer"], inner["generation"]) == (hill.name, 2)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["decay_step_norm"] > 0 for r in records if r.get("generation", -1) >= 0] == [
        True,
        True,
    ]
