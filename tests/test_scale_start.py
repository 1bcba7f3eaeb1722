"""optimizer.start: scale_baseline: the search starts at the no-search baseline's scaled adapter.

On the demo model (the scale baseline is cheap there): with zero generations the exported
adapter is the start itself, so its held-out pass must reproduce the scale baseline's item by
item; a killed run resumes onto the same start and the same trajectory.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.test_train_e2e import adapter_tensors, essa, sets

SMALL = [
    "sft.steps=6",
    "data.sft_size=16",
    "data.test_size=24",
    "data.batch_size=8",
    "optimizer.population_size=4",
    "evaluation.every=0",
    "run.show_progress=false",
    "optimizer.start=scale_baseline",
    "evaluation.use_scale_baseline=false",  # implied by the start
]


def passes(run_dir: Path) -> dict[str, list[float]]:
    out = {}
    for line in (run_dir / "heldout_scores.jsonl").read_text().splitlines():
        record = json.loads(line)
        out["final" if record["final"] else record.get("pass", "")] = record["scores"]
    return out


@pytest.mark.slow
def test_zero_generations_export_the_scale_baselines_adapter(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    res = essa("train", "--run-dir", str(run_dir), *sets(*SMALL, "run.generations=0"))
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["scale_baseline_ran"] is True
    factor = summary["scale_baseline"]["factor"]
    assert f"the search starts at the SFT adapter x{factor:g}" in res.stdout
    scores = passes(run_dir)
    assert scores["final"] == scores["scale baseline held-out"]
    assert factor != 1.0, "the demo's scale baseline chose x1: the test would prove nothing"
    sft = load_file(str(Path(summary["sft_adapter_dir"]) / "adapter_model.safetensors"))
    out = adapter_tensors(run_dir)  # the start, exported: not the SFT adapter (offsets 0)
    assert any(not torch.allclose(sft[k], out[k]) for k in out if k in sft)


@pytest.mark.slow
def test_resume_after_a_kill_keeps_the_start(tmp_path: Path) -> None:
    args = sets(*SMALL, "run.generations=4")
    ref = tmp_path / "ref"
    res = essa("train", "--run-dir", str(ref), *args)
    assert res.returncode == 0, res.stderr[-3000:]
    killed = tmp_path / "killed"
    res = essa("train", "--run-dir", str(killed), *args, env={"ESSA_FAULT": "kill@2"})
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    res = essa("train", "--resume", str(killed))
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = adapter_tensors(ref), adapter_tensors(killed)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert passes(ref)["final"] == passes(killed)["final"]
    factor = json.loads((ref / "summary.json").read_text())["scale_baseline"]["factor"]
    for run_dir in (ref, killed):  # the optimizer's recorded start is the scaled adapter
        x0 = json.loads((run_dir / "checkpoint.json").read_text())["optimizer"]["config"]["x0"]
        assert bool(np.any(np.asarray(x0) != 0.0)) is (factor != 1.0)


@pytest.mark.slow
def test_resume_after_a_kill_keeps_the_sft_start_when_validation_rejected_the_scaled_one(
    tmp_path: Path,
) -> None:
    """A scaled start that does not beat the SFT adapter on validation is not searched from;
    the resumed run rebuilds its optimizer at the same (SFT) start and continues exactly."""
    args = sets(*SMALL, "data.val_size=16", "run.generations=3")
    ref = tmp_path / "ref"
    res = essa("train", "--run-dir", str(ref), *args)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "did not beat the SFT adapter on validation" in res.stdout  # the case under test
    killed = tmp_path / "killed"
    res = essa("train", "--run-dir", str(killed), *args, env={"ESSA_FAULT": "kill@2"})
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    res = essa("train", "--resume", str(killed))
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = adapter_tensors(ref), adapter_tensors(killed)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    for run_dir in (ref, killed):  # the optimizer's recorded start is the SFT adapter
        x0 = json.loads((run_dir / "checkpoint.json").read_text())["optimizer"]["config"]["x0"]
        assert not np.any(np.asarray(x0))


@pytest.mark.slow
def test_resume_after_a_kill_with_the_mean_decaying_toward_the_start(tmp_path: Path) -> None:
    """optimizer.drift_budget.decay from the scaled start: the decay's offset is in the
    checkpoint, so a killed run resumes onto the same trajectory bit for bit."""
    args = sets(*SMALL, "run.generations=4", "optimizer.drift_budget.decay=0.1")
    ref = tmp_path / "ref"
    res = essa("train", "--run-dir", str(ref), *args)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "the mean decays toward the start by 0.1 a generation" in res.stdout
    killed = tmp_path / "killed"
    res = essa("train", "--run-dir", str(killed), *args, env={"ESSA_FAULT": "kill@2"})
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    res = essa("train", "--resume", str(killed))
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = adapter_tensors(ref), adapter_tensors(killed)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert passes(ref)["final"] == passes(killed)["final"]
    states = [json.loads((d / "checkpoint.json").read_text())["optimizer"] for d in (ref, killed)]
    assert states[0] == states[1] and states[0]["optimizer"] == "mean_decay"
    assert np.any(np.asarray(states[0]["offset"]) != 0.0)


# ----------------------------------------------------------------- the tie-breaker's check


def test_reference_check_drops_a_tie_breaker_that_picks_what_the_reward_rates_lower() -> None:
    from essa.es.start import SCALE_FACTORS, reference_check

    rng = np.random.default_rng(0)
    per_prompt = (rng.random((8, 64)) < 0.2).astype(float)  # (8, N): factor x prompt
    per_prompt[0] = (rng.random(64) < 0.7).astype(float)  # x0.5: the reward's clear choice
    rising = np.tile(np.linspace(-2.0, -0.5, 8)[:, None], 64)  # grows with the factor
    check = reference_check(per_prompt, rising, 1.0)
    assert check["factor"] == SCALE_FACTORS[7] and not check["agrees"]
    assert check["reward_without"] == pytest.approx(per_prompt[0].mean())
    assert check["reward_with"] == pytest.approx(per_prompt[7].mean())
    # a weight so small that the term only breaks the reward's ties: the same picks, kept
    tiny = reference_check(per_prompt, rising, 1e-6)
    assert tiny["agrees"] and tiny["reward_with"] == tiny["reward_without"]
    # the same term peaking at the reward's choice: kept
    peaked = np.tile(-np.abs(np.arange(8.0))[:, None], 64)
    assert reference_check(per_prompt, peaked, 1.0)["agrees"]
    # no reference scored anywhere, or one prompt: nothing to check
    assert reference_check(per_prompt, np.full((8, 64), np.nan), 1.0)["agrees"]
    assert reference_check(per_prompt[:, :1], rising[:, :1], 1.0)["agrees"]


def test_scale_baseline_checks_the_tie_breaker_it_reads_in_its_own_prefill(
    tiny_model_dir: Path,
) -> None:
    from conftest import svd_setup

    from essa.backends.evaluator import PopulationEvaluator
    from essa.config import EvaluationConfig, GenerationConfig
    from essa.es.generation import reference_term
    from essa.es.start import SCALE_FACTORS, scale_baseline, scale_vector
    from essa.rewards import get_reward
    from essa.types import Example

    model, tokenizer, adapter = svd_setup(tiny_model_dir)
    evaluator = PopulationEvaluator(
        model, tokenizer, adapter, GenerationConfig(max_new_tokens=3), EvaluationConfig()
    )
    train = [Example(f"{a}+{b}=", str(a + b)) for a, b in ((1, 2), (3, 4), (12, 9), (5, 5))]
    prompts = [ex.prompt for ex in train]
    answers = [ex.answer for ex in train]
    reward = get_reward("exact_match")
    plain = scale_baseline(evaluator, adapter, train, prompts, reward, 0, None)
    checked = scale_baseline(
        evaluator, adapter, train, prompts, reward, 0, None, references=answers
    )
    assert plain is not None and checked is not None
    assert "reference_check" not in plain
    assert {k: checked[k] for k in plain} == plain  # the check changes no choice
    # the fitness's pick is the factor with the largest term (the reward ties at 0 on the
    # random model), read in a pass of its own
    population = np.stack([scale_vector(adapter, f) for f in SCALE_FACTORS])
    order = np.random.default_rng(0).permutation(len(train))  # any prompt order: a mean
    evaluator.completions(
        population, [prompts[i] for i in order], references=[answers[i] for i in order]
    )
    dense = reference_term(evaluator.last_reference_logprobs)
    assert checked["train_fitness"] == 0.0
    assert checked["reference_check"]["factor"] == SCALE_FACTORS[int(np.argmax(dense))]


@pytest.mark.slow
def test_a_run_searches_with_the_tie_breaker_its_check_kept(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = sets(*SMALL, "run.generations=2", "reward.reference_weight=1")
    res = essa("train", "--run-dir", str(run_dir), *args)
    assert res.returncode == 0, res.stderr[-3000:]
    check = json.loads((run_dir / "summary.json").read_text())["scale_baseline"]["reference_check"]
    verdict = "kept" if check["agrees"] else "off, the reward alone ranks"
    assert f"reference tie-breaker checked: {verdict}" in res.stdout
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    searched = [json.loads(x) for x in lines if '"mean_fitness"' in x]
    assert len(searched) == 2
    assert all(("reference_logprob" in r) is check["agrees"] for r in searched)


def test_a_failed_check_turns_the_tie_breaker_off_and_says_so() -> None:
    from essa.config import load_config
    from essa.es.settings import checked_reward

    said: list[str] = []
    reward = load_config(None, ["reward.reference_weight=1"]).reward
    check = {"agrees": False, "factor": 1.5, "reward_with": 0.1, "reward_without": 0.25}
    off = checked_reward(reward, said.append, {"scale_baseline": {"reference_check": check}})
    assert off.reference_weight == 0.0 and reward.reference_weight == 1.0
    assert said == [
        "reference tie-breaker checked: off, the reward alone ranks (factors chosen on half "
        "the training prompts score 0.100 on the other half with it, 0.250 by the reward alone)"
    ]
    kept = checked_reward(
        reward, said.append, {"scale_baseline": {"reference_check": {**check, "agrees": True}}}
    )
    assert kept is reward and said[-1].startswith("reference tie-breaker checked: kept")
    assert checked_reward(reward, said.append, {"scale_baseline": {"factor": 2.0}}) is reward
    unchecked = {"agrees": True, "factor": None, "reward_with": None, "reward_without": None}
    state = {"scale_baseline": {"reference_check": unchecked}}
    assert checked_reward(reward, said.append, state) is reward and len(said) == 2
