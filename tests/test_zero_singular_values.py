"""SFT adapters with zero singular values: ESSA searches the values a relative step can move and
refuses, in one line, an adapter where none can (an untrained LoRA, or lora_alpha 0).

A zero singular value has a zero relative step (its coordinate is held at its start); a module
whose B or A is zero keeps B'A' = 0 whatever its other factor does, so none of its values is
searched either.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from essa.config import load_config
from tests import cli_runner

TESTS = Path(__file__).parent
K = 4  # rank 4, adapter.alpha 1: every module has 2 * 4 coordinates (A then B)
# Modules in layout order: layer 0 q, k, v, o, then layer 1 q, k, v, o.
DEAD = 0  # layers.0.self_attn.q_proj: B never trained (zero)
LOW_RANK = 6  # layers.1.self_attn.v_proj: B of rank 2 (its last two singular values are zero)


def tiny_run(model_dir: Path, *extra: str) -> list[str]:
    """--set arguments of a seconds-long run on the tiny model (test_mpi's settings)."""
    items = [
        f"model.name_or_path={model_dir}",
        "data.sft_size=16",
        "data.batch_size=4",
        "data.test_size=4",
        "optimizer.population_size=4",
        "optimizer.sigma0=3",
        "evaluation.every=0",
        "evaluation.use_scale_baseline=false",
        "run.show_progress=false",
        "reward.name=mpi_helpers:char_variety",  # graded even on a random model
        "generation.max_new_tokens=4",
        # No validation: the random model scores 0 on it, so the run would keep its start; the
        # search's mean is exported unchecked.
        "data.val_size=0",
        *extra,
    ]
    return [arg for item in items for arg in ("--set", item)]


def essa(*args: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    return cli_runner.essa(*args, env={"PYTHONPATH": path})


def one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def save_lora(model_dir: Path, out: Path, *, trained: bool):  # type: ignore[no-untyped-def]
    """A rank-4 LoRA on the tiny model saved at ``out``; returns its SVDAdapter.

    trained: random B, except a zero B in module DEAD and a rank-2 B in module LOW_RANK;
    else PEFT's initialisation (B = 0), as ``sft.steps: 0`` leaves it.
    """
    from essa.adapters import SVDAdapter
    from essa.backends.models import load_model
    from essa.config import AdapterConfig, ModelConfig
    from essa.gradient.sft import make_lora_model

    model, _ = load_model(ModelConfig(name_or_path=str(model_dir)))
    peft_model = make_lora_model(model, AdapterConfig(rank=K, lora_alpha=8))
    gen = torch.Generator().manual_seed(1)
    for name, param in peft_model.named_parameters():
        if trained and "lora_B" in name:
            param.data = torch.randn(param.shape, generator=gen) * 0.3
            if "layers.0.self_attn.q_proj" in name:
                param.data.zero_()
            if "layers.1.self_attn.v_proj" in name:
                param.data[:, 2:] = 0.0
    peft_model.save_pretrained(str(out))
    return SVDAdapter.from_peft_model(peft_model, alpha=1.0)


@pytest.fixture(scope="module")
def partly_zero(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp("lora") / "partly-zero"
    return out, save_lora(tiny_model_dir, out, trained=True)


def expected_free() -> np.ndarray:
    free = np.ones(8 * 2 * K, dtype=bool)
    free[DEAD * 2 * K : (DEAD + 1) * 2 * K] = False  # A and B of the dead module
    free[LOW_RANK * 2 * K + K + 2 : (LOW_RANK + 1) * 2 * K] = False  # B's zero values
    return free


def test_searchable_marks_zero_values_and_dead_modules(partly_zero) -> None:  # type: ignore[no-untyped-def]
    _, adapter = partly_zero
    assert adapter.searchable().tolist() == expected_free().tolist()
    assert np.all(adapter.stds()[expected_free()] > 0)


OPTIMIZERS = {
    "cma_es": [],
    "openai_es": ["optimizer.name=openai_es"],
    "layerwise": ["optimizer.layerwise.active_layers=1", "optimizer.layerwise.interval=2"],
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_zero_singular_values_stay_put_and_the_rest_is_searched(partly_zero, name: str) -> None:  # type: ignore[no-untyped-def]
    """Relative steps search the non-zero values only; the state resumes exactly."""
    from essa.es.optimizer import make_es_optimizer
    from essa.optimizers.subspace import Subspace

    _, adapter = partly_zero
    cfg = load_config(None, ["optimizer.population_size=4", *OPTIMIZERS[name]])
    free = expected_free()
    x0 = np.where(free, 0.5, 0.0) * adapter.stds()  # a scale-baseline-like start
    opt = make_es_optimizer(cfg.optimizer, cfg.run.seed, adapter, x0=x0)
    assert isinstance(opt, Subspace) and opt.inner.dim == int(free.sum())
    rng = np.random.default_rng(0)
    for _ in range(3):
        population = opt.ask()  # (P, D)
        assert np.array_equal(population[:, ~free], np.zeros((4, int((~free).sum()))))
        opt.tell(population, rng.normal(size=4))
    assert np.all(opt.mean[~free] == 0.0) and np.any(opt.mean[free] != x0[free])
    resumed = make_es_optimizer(cfg.optimizer, cfg.run.seed, adapter, x0=x0)
    resumed.load_state_dict(json.loads(json.dumps(opt.state_dict())))
    assert np.array_equal(resumed.ask(), opt.ask())
    assert resumed.checksum() == opt.checksum()


def test_flat_reward_widens_sigma_around_fixed_values(partly_zero) -> None:  # type: ignore[no-untyped-def]
    from essa.es.optimizer import make_es_optimizer, tell

    _, adapter = partly_zero
    cfg = load_config(None, ["optimizer.population_size=4", "optimizer.escape_flat_reward=true"])
    opt = make_es_optimizer(cfg.optimizer, cfg.run.seed, adapter)
    metrics = tell(
        cfg.optimizer, opt, opt.ask(), np.array([1.0, 0.0, 0.0, 0.0]), {"reward_flat": 1.0}
    )
    assert metrics["sigma_widened"] == 1.0


@pytest.mark.slow
def test_train_searches_a_partly_zero_adapter(
    partly_zero, tiny_model_dir: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    path, _ = partly_zero
    run_dir = tmp_path / "run"
    overrides = tiny_run(tiny_model_dir, f"adapter.path={path}", "run.generations=2")
    res = essa("train", "--run-dir", str(run_dir), *overrides)
    assert res.returncode == 0, res.stderr[-3000:]
    checkpoint = json.loads((run_dir / "checkpoint.json").read_text())["optimizer"]
    assert checkpoint["optimizer"] == "subspace"
    assert checkpoint["config"]["free"] == np.flatnonzero(expected_free()).tolist()
    manifest = json.loads((run_dir / "adapter" / "essa_manifest.json").read_text())
    vector = np.asarray(manifest["vector"])  # the exported mean
    assert np.all(vector[~expected_free()] == 0.0) and np.any(vector[expected_free()] != 0.0)


def test_untrained_adapter_path_is_refused_before_the_baseline(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    untrained = tmp_path / "untrained"
    save_lora(tiny_model_dir, untrained, trained=False)
    run_dir = tmp_path / "run"
    res = essa(
        "train", "--run-dir", str(run_dir), *tiny_run(tiny_model_dir, f"adapter.path={untrained}")
    )
    line = one_error_line(res)
    assert f"adapter.path: {untrained} is an untrained LoRA" in line
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text()
    assert not (run_dir / "summary.json").exists()


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("adapter.lora_alpha=0", "--set adapter.lora_alpha: adapter.lora_alpha: must be > 0"),
        ("sft.steps=0", "--set sft.steps: sft.steps: must be > 0 without adapter.path"),
    ],
)
def test_zero_adapter_by_config_is_refused_before_the_model_loads(
    tmp_path: Path, override: str, fragment: str
) -> None:
    run_dir = tmp_path / "run"
    line = one_error_line(essa("train", "--run-dir", str(run_dir), "--set", override))
    assert line.startswith(f"error: {fragment}")
    assert not run_dir.exists()  # refused at validation: nothing written, no model loaded


def test_zero_sft_steps_allowed_where_it_can_work() -> None:
    """Absolute steps move zero singular values; GRPO trains B from zero; a given adapter
    is not the SFT stage's."""
    load_config(None, ["sft.steps=0", "optimizer.use_relative_steps=false"])
    load_config(None, ["sft.steps=0", "algorithm=grpo"])
    load_config(None, ["sft.steps=0", "adapter.path=/some/lora"])
