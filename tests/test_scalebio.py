"""ScaleBiO: one weight update by hand, and `essa train` on the demo model with a clean and a
pure-noise source: the clean source's weight rises, and a run killed mid-checkpoint resumes
exactly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from essa.config import ConfigError, load_config
from essa.gradient.bilevel import softmax, weight_update
from tests.test_train_e2e import essa, sets


def test_weight_update_by_hand() -> None:
    # logits (0, ln 3): w = (1/4, 3/4). d = L(theta) - L(u) = (0.2, -0.4) - ... see below.
    logits = np.array([0.0, math.log(3.0)])
    loss_theta = np.array([1.0, 2.0])
    loss_u = np.array([0.8, 2.4])  # d = (0.2, -0.4)
    # w.d = 0.05 - 0.3 = -0.25; d - w.d = (0.45, -0.15)
    # grad = lambda * w * (d - w.d) = 2 * (0.1125, -0.1125) = (0.225, -0.225)
    # a - lr * grad with lr 0.5: (-0.1125, ln 3 + 0.1125)
    new = weight_update(logits, loss_theta, loss_u, penalty=2.0, lr=0.5)
    assert new == pytest.approx([-0.1125, math.log(3.0) + 0.1125], abs=1e-12)
    # The source the validation-guided theta fits worse than u (source 0) loses weight.
    assert softmax(new)[0] < 0.25


def test_weight_update_is_the_softmax_gradient_of_the_penalty() -> None:
    """Against autograd: d/da lambda * sum_k softmax(a)_k (L_k(theta) - L_k(u))."""
    rng = np.random.default_rng(0)
    logits, loss_theta, loss_u = rng.normal(size=3), rng.random(3), rng.random(3)
    a = torch.tensor(logits, requires_grad=True)
    penalty = 1.7
    (penalty * (torch.softmax(a, 0) * torch.tensor(loss_theta - loss_u)).sum()).backward()
    assert a.grad is not None
    expected = logits - 0.3 * a.grad.numpy()
    assert weight_update(logits, loss_theta, loss_u, penalty, 0.3) == pytest.approx(expected)


def test_equal_losses_leave_the_weights_alone() -> None:
    logits = np.array([0.3, -0.1])
    assert weight_update(logits, np.ones(2), np.ones(2), 1.0, 1.0).tolist() == logits.tolist()


def test_sources_need_scalebio_and_two_of_them(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.sources: a mixture of sources is trained by"):
        load_config(None, ["data.sources={a: x.jsonl, b: y.jsonl}"])
    with pytest.raises(ConfigError, match="data.sources: scalebio reweights two or more"):
        load_config(None, ["algorithm=scalebio", "data.sources={a: x.jsonl}"])


def write_sources(directory: Path) -> tuple[Path, Path]:
    """Clean (right sums) and noise (the answers of other questions) from the training pool."""
    from essa.data.loaders import builtin_examples

    train, _ = builtin_examples("builtin:arithmetic")
    rng = np.random.default_rng(0)
    order = rng.permutation(len(train))
    clean, noisy = [train[i] for i in order[:300]], [train[i] for i in order[300:600]]
    shuffled = [noisy[i].answer for i in rng.permutation(len(noisy))]
    paths = directory / "clean.jsonl", directory / "noise.jsonl"
    paths[0].write_text(
        "".join(json.dumps({"question": e.prompt, "answer": e.answer}) + "\n" for e in clean)
    )
    paths[1].write_text(
        "".join(
            json.dumps({"question": e.prompt, "answer": a}) + "\n"
            for e, a in zip(noisy, shuffled, strict=True)
        )
    )
    return paths


def small(directory: Path, steps: int) -> list[str]:
    clean, noise = write_sources(directory)
    return [
        "algorithm=scalebio",
        f"data.sources={{clean: {clean}, noise: {noise}}}",
        "data.sft_size=32",
        "data.test_size=40",
        "evaluation.every=4",
        "scalebio.lr=1e-4",
        "scalebio.weight_lr=5",
        "scalebio.lisa.interval=3",
        f"run.generations={steps}",
        "run.show_progress=false",
    ]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def eight_steps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """(run dir, overrides) of an uninterrupted 8-step run: checked for the weights it learned,
    and the run the killed one must resume onto (run once; the tests only read it)."""
    tmp = tmp_path_factory.mktemp("scalebio")
    overrides = small(tmp, 8)
    res = essa("train", "--run-dir", str(tmp / "run"), *sets(*overrides))
    assert res.returncode == 0, res.stderr[-3000:]
    return tmp / "run", overrides


@pytest.mark.slow
def test_clean_source_gains_weight_over_noise(eight_steps: tuple[Path, list[str]]) -> None:
    run_dir, _ = eight_steps
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["algorithm"] == "scalebio" and summary["generations"] == 8
    weights = summary["source_weights"]
    assert set(weights) == {"clean", "noise"} and sum(weights.values()) == pytest.approx(1.0)
    assert weights["clean"] > 0.6, weights  # from 0.5
    recs = records(run_dir)
    assert recs[0]["event"] == "baseline" and recs[0]["weight/clean"] == 0.5
    steps = [r for r in recs if r["generation"] >= 0]
    assert [r["generation"] for r in steps] == list(range(8))
    assert steps[-1]["weight/clean"] == pytest.approx(weights["clean"])
    for r in steps:
        assert r["weight/clean"] + r["weight/noise"] == pytest.approx(1.0)
        assert math.isfinite(r["validation_loss"])
    # The noise is noise: the model's loss on it stays far above its loss on the clean source.
    assert steps[-1]["loss_u/noise"] > steps[-1]["loss_u/clean"]
    assert (run_dir / "model" / "model.safetensors").exists()
    assert 0.0 <= summary["final_accuracy"] <= 1.0


@pytest.mark.slow
def test_scalebio_resume_after_kill_is_exact(
    tmp_path: Path, eight_steps: tuple[Path, list[str]]
) -> None:
    """kill -9 inside the step-3 checkpoint write (after a LISA re-sampling at step 3), resume:
    the same weights, logits and records as an uninterrupted run."""
    ref, overrides = eight_steps
    run_dir = tmp_path / "killed"
    res = essa("train", "--run-dir", str(run_dir), *sets(*overrides), env={"ESSA_FAULT": "kill@3"})
    assert res.returncode == -9, res.stderr[-3000:]
    assert json.loads((run_dir / "checkpoint" / "state.json").read_text())["step"] == 2
    res = essa("train", "--resume", str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    a = load_file(str(ref / "model" / "model.safetensors"))
    b = load_file(str(run_dir / "model" / "model.safetensors"))
    for key in a:
        assert torch.equal(a[key], b[key]), key
    sa = json.loads((ref / "summary.json").read_text())
    sb = json.loads((run_dir / "summary.json").read_text())
    assert sa["source_logits"] == sb["source_logits"]

    def strip(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]

    assert strip(records(run_dir)) == strip(records(ref))


def test_missing_source_file_is_one_error_line_through_the_cli(tmp_path: Path) -> None:
    clean, _ = write_sources(tmp_path)
    missing = tmp_path / "nope.jsonl"
    overrides = ["algorithm=scalebio", f"data.sources={{clean: {clean}, noise: {missing}}}"]
    res = essa("train", "--run-dir", str(tmp_path / "run"), *sets(*overrides))
    assert res.returncode == 2
    assert res.stderr.strip() == f"error: data.sources.noise: {missing}: no such file"


def test_scalebio_refuses_an_adapter() -> None:
    overrides = ["algorithm=scalebio", "data.sources={a: x.jsonl, b: y.jsonl}", "adapter.path=lora"]
    with pytest.raises(ConfigError, match="adapter.path: scalebio fine-tunes the base weights"):
        load_config(None, overrides)
