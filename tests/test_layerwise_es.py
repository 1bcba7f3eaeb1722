"""Layerwise ES: only the active layers' singular values move; exact resume; CLI end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from essa.adapters.blocks import layer_blocks
from essa.optimizers import Optimizer
from essa.optimizers.layerwise import LayerwiseES, active_layers, block_seed

LAYERS = [list(range(i, 24, 4)) for i in range(4)]  # interleaved on purpose: 4 layers x 6 coords


def make(base: str = "cma_es", **kwargs) -> LayerwiseES:
    args = {
        "layer_indices": LAYERS,
        "active_layers": 2,
        "interval": 3,
        "base": base,
        "population_size": 6,
        "sigma0": 0.5,
        "seed": 11,
        "stds": np.linspace(0.5, 2.0, 24),
    }
    return LayerwiseES(24, **{**args, **kwargs})


def fitness_of(population: np.ndarray) -> np.ndarray:
    return -np.sum((population - 1.0) ** 2, axis=1)  # (P,)


def coords(layers: tuple[int, ...]) -> np.ndarray:
    return np.sort(np.concatenate([LAYERS[i] for i in layers]))


@pytest.mark.parametrize("base", ["cma_es", "openai_es"])
def test_only_active_layers_move_and_learned_values_are_kept(base: str) -> None:
    opt = make(base)
    assert isinstance(opt, Optimizer)
    learned = np.zeros(24)
    for g in range(12):
        block = g // 3
        assert opt.active == active_layers(11, block, 4, 2)
        inactive = np.setdiff1d(np.arange(24), coords(opt.active))
        before = opt.mean
        np.testing.assert_array_equal(before[inactive], learned[inactive])
        population = opt.ask()
        assert np.all(population[:, inactive] == before[inactive])  # (P, D - d) pinned
        assert np.ptp(population[:, coords(opt.active)], axis=0).min() > 0
        opt.tell(population, fitness_of(population))
        np.testing.assert_array_equal(opt.mean[inactive], before[inactive])
        if (g + 1) % 3 == 0:  # switch: the next block starts from everything learned so far
            learned = opt.mean
    assert opt.generation == 12
    searched = {i for t in range(4) for i in active_layers(11, t, 4, 2)}
    for layer, index in enumerate(LAYERS):
        assert np.all(opt.mean[index] != 0) == (layer in searched), layer
        assert np.all(opt.mean[index] == 0) == (layer not in searched), layer


def test_block_restarts_at_sigma0_or_carries_sigma() -> None:
    reset, carried = make(), make(use_carried_sigma=True)
    for opt in (reset, carried):
        for _ in range(3):
            population = opt.ask()
            opt.tell(population, fitness_of(population))
    assert reset.sigma == 0.5
    assert carried.sigma != 0.5
    assert block_seed(11, 1) != block_seed(11, 2)


@pytest.mark.parametrize("base", ["cma_es", "openai_es"])
def test_resume_mid_block_equals_uninterrupted(base: str) -> None:
    reference = make(base)
    asks = []
    for g in range(11):
        population = reference.ask()
        asks.append(population)
        fitness = fitness_of(population)
        fitness[g % 6] = np.nan if g == 4 else fitness[g % 6]  # a failed candidate
        reference.tell(population, fitness)
    resumed = make(base)
    for g in range(7):
        population = resumed.ask()
        fitness = fitness_of(population)
        fitness[g % 6] = np.nan if g == 4 else fitness[g % 6]
        resumed.tell(population, fitness)
    state = json.loads(json.dumps(resumed.state_dict()))  # the checkpoint is plain JSON
    fresh = make(base)
    fresh.load_state_dict(state)
    assert fresh.checksum() == resumed.checksum()
    for g in range(7, 11):
        population = fresh.ask()
        np.testing.assert_array_equal(population, asks[g])
        fitness = fitness_of(population)
        fresh.tell(population, fitness)
    assert fresh.checksum() == reference.checksum()
    np.testing.assert_array_equal(fresh.mean, reference.mean)


def test_rejects_bad_arguments_and_foreign_population() -> None:
    with pytest.raises(ValueError, match="active_layers"):
        make(active_layers=5)
    with pytest.raises(ValueError, match="partition"):
        make(layer_indices=LAYERS[:3])
    opt = make()
    population = opt.ask()
    population[:, coords(tuple(set(range(4)) - set(opt.active)))[0]] += 1.0
    with pytest.raises(ValueError, match="exact population"):
        opt.tell(population, fitness_of(population))
    with pytest.raises(ValueError, match="different constructor"):
        make(interval=4).load_state_dict(opt.state_dict())


def test_schedule_and_constructor_validate_their_inputs() -> None:
    for weights in ([1.0, 1.0, 1.0], [1.0, -1.0, 1.0, 1.0], [1.0, np.nan, 1.0, 1.0]):
        with pytest.raises(ValueError, match="4 finite values >= 0"):
            active_layers(0, 0, 4, 2, weights)
    with pytest.raises(ValueError, match="at least 2 layers"):
        active_layers(0, 0, 4, 2, [1.0, 0.0, 0.0, 0.0])
    assert active_layers(0, 3, 4, 2, [0.0, 1.0, 0.0, 1.0]) == (1, 3)  # zero weight: never
    with pytest.raises(ValueError, match="stds"):
        make(stds=np.zeros(24))
    idle = next(i for i in range(4) if i not in make().active)  # not searched in block 0
    stds = np.linspace(0.5, 2.0, 24)
    stds[LAYERS[idle][0]] = 0.0  # the first block's optimizer never sees it: checked up front
    with pytest.raises(ValueError, match="stds must be > 0"):
        make(stds=stds)
    with pytest.raises(ValueError, match="interval"):
        make(interval=0)
    assert make().state_dict()["format"] == 1


def test_layer_of_reads_the_decoder_layer_index() -> None:
    from essa.adapters.blocks import layer_of

    assert layer_of("model.layers.12.self_attn.q_proj") == 12
    assert layer_of("lm_head") is None
    manifest = {"modules": [{"name": "lm_head", "slice_a": (0, 1), "slice_b": (1, 2)}]}
    with pytest.raises(ValueError, match="lm_head belongs to no numbered layer"):
        layer_blocks(manifest)


def test_layer_blocks_from_a_real_adapter_manifest() -> None:
    import torch

    from essa.adapters import SVDAdapter

    gen = torch.Generator().manual_seed(0)
    names = [f"model.layers.{i}.self_attn.{m}" for i in (0, 1, 2) for m in ("v_proj", "q_proj")]
    lora_a = {n: torch.randn(4, 16, generator=gen) for n in names}
    lora_b = {n: torch.randn(16, 4, generator=gen) for n in names}
    adapter = SVDAdapter.from_lora_state(lora_a, lora_b, 2.0, alpha=0.5)
    blocks = layer_blocks(adapter.manifest())
    assert len(blocks) == 3
    assert sorted(i for b in blocks for i in b) == list(range(adapter.dim))
    for layer, block in enumerate(blocks):
        for module in adapter.modules:
            if f"layers.{layer}." in module.name:
                assert set(range(module.slice_a.start, module.slice_b.stop)) <= set(block)
    with pytest.raises(ValueError, match="no numbered layer"):
        layer_blocks({"modules": [{"name": "lm_head", "slice_a": [0, 1], "slice_b": [1, 2]}]})


# end to end on the 2-layer test model ----------------------------------------------------

SMALL = [
    "sft.steps=10",
    "sft.lr=0.01",  # as in test_mpi: an adapter strong enough for candidates to differ
    "data.sft_size=16",
    "data.batch_size=4",
    "data.test_size=8",
    "optimizer.population_size=4",
    "optimizer.layerwise.active_layers=1",
    "optimizer.layerwise.interval=2",
    "evaluation.every=0",
    "evaluation.use_scale_baseline=false",
    "run.show_progress=false",
    # No validation: the random model scores 0 there and the run would keep its start.
    "data.val_size=0",
    # A graded reward: a random model scores 0 on math everywhere, and flat fitness now (rightly)
    # leaves CMA-ES where it is, so the sampled layers would never move.
    "reward.name=mpi_helpers:char_variety",
    # The tiny model is not builtin:demo: pin the demo's values the schema no longer defaults to.
    "generation.max_new_tokens=8",
    "optimizer.sigma0=3.0",
    "sft.batch_size=100",
]


@pytest.mark.slow
def test_layerwise_train_resumes_exactly_and_moves_only_sampled_layers(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from essa.config import load_config
    from essa.recipes import essa_es

    def config(generations: int):  # noqa: ANN202
        small = [*SMALL, f"model.name_or_path={tiny_model_dir}"]
        return load_config(None, [*small, f"run.generations={generations}"])

    ref, split = tmp_path / "ref", tmp_path / "split"
    for run_dir in (ref, split):
        run_dir.mkdir()
    essa_es.run(config(5), ref)
    essa_es.run(config(3), split)
    essa_es.run(config(5), split, resume=True)
    a = json.loads((ref / "checkpoint.json").read_text())
    b = json.loads((split / "checkpoint.json").read_text())
    assert a["optimizer"] == b["optimizer"]
    mean = np.asarray(a["optimizer"]["anchor"])  # the full vector at the last switch (gen 4)
    manifest = json.loads((ref / "adapter" / "essa_manifest.json").read_text())
    blocks = layer_blocks(manifest)
    assert len(blocks) == 2
    searched = {i for t in (0, 1) for i in active_layers(0, t, len(blocks), 1)}
    for layer, block in enumerate(blocks):
        assert np.any(mean[block] != 0) == (layer in searched), layer


def test_active_layers_above_model_layers_is_one_line_error(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from typer.testing import CliRunner

    from essa.cli import app

    items = [*SMALL, f"model.name_or_path={tiny_model_dir}", "optimizer.layerwise.active_layers=3"]
    args = [arg for item in items for arg in ("--set", item)]
    res = CliRunner().invoke(app, ["train", "--run-dir", str(tmp_path / "r"), *args])
    assert res.exit_code == 2
    # The line before, if any, is the tiny-SFT warning (the tiny model is not builtin:demo).
    assert res.stderr.splitlines()[-1] == (
        "error: optimizer.layerwise.active_layers: must be in 1..2 (the adapter's layers), got 3"
    )
    assert res.stderr.count("error:") == 1 and res.stderr.endswith("\n")


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.component("mpi")
def test_layerwise_two_ranks_match_one_rank(tmp_path: Path, tiny_model_dir: Path) -> None:
    from tests.test_mpi import assert_same_adapter, mpi_ready, small, train, trajectory

    if mpi_ready():
        pytest.skip(mpi_ready())
    layerwise = ["optimizer.layerwise.active_layers=1", "optimizer.layerwise.interval=1"]
    sets = small(tiny_model_dir, "run.generations=3", *layerwise)
    one, two = tmp_path / "one", tmp_path / "two"
    train(0, "--run-dir", str(one), sets=sets)
    train(2, "--run-dir", str(two), sets=sets)
    assert trajectory(two) == trajectory(one)  # the blocks switch after every generation
    assert [r.get("block") for r in trajectory(one)[1:]] == [0.0, 1.0, 2.0]
    assert_same_adapter(two, one)
