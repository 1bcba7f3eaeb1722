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


# ----------------------------------------------------------------- the tie-breaker's check


def test_reference_check_drops_a_tie_breaker_that_prefers_what_the_reward_ranks_lower() -> None:
    from essa.es.start import SCALE_FACTORS, reference_check

    rng = np.random.default_rng(0)
    per_prompt = (rng.random((8, 64)) < 0.2).astype(float)  # (8, N): factor x prompt
    per_prompt[0] = (rng.random(64) < 0.7).astype(float)  # x0.5: the reward's clear choice
    fitness = per_prompt.mean(1)
    rising = np.linspace(-2.0, -0.5, 8)  # the term grows with the factor, as sharpening does
    check = reference_check(fitness, rising, per_prompt)
    assert check["factor"] == SCALE_FACTORS[7] and not check["agrees"]
    assert check["reward_drop"] == pytest.approx(fitness[0] - fitness[7])
    assert check["reward_drop"] > 2 * check["se"] > 0
    # the same term peaking at the reward's choice: kept
    peaked = -np.abs(np.arange(8.0))
    assert reference_check(fitness, peaked, per_prompt) == {
        "agrees": True, "factor": 0.5, "reward_drop": 0.0, "se": 0.0,
    }  # fmt: skip
    # a favourite within noise of the reward's choice (one prompt of 64 lower): kept
    close = per_prompt.copy()
    close[7] = close[0]
    close[7, np.flatnonzero(close[0])[0]] = 0.0
    kept = reference_check(close.mean(1), rising, close)
    assert kept["agrees"] and kept["reward_drop"] == pytest.approx(1 / 64)
    # no reference scored anywhere: nothing to check
    assert reference_check(fitness, np.full(8, np.nan), per_prompt)["agrees"]


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
    # the favourite is the factor with the largest term, read in a pass of its own
    population = np.stack([scale_vector(adapter, f) for f in SCALE_FACTORS])
    order = np.random.default_rng(0).permutation(len(train))  # any prompt order: a mean
    evaluator.completions(
        population, [prompts[i] for i in order], references=[answers[i] for i in order]
    )
    dense = reference_term(evaluator.last_reference_logprobs)
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
    from essa.recipes.essa_es import _checked_tie_breaker

    said: list[str] = []

    class Say:
        def say(self, line: str) -> None:
            said.append(line)

    cfg = load_config(None, ["reward.reference_weight=1"])
    check = {"agrees": False, "factor": 1.5, "reward_drop": 0.2, "se": 0.05}
    off = _checked_tie_breaker(cfg, Say(), {"scale_baseline": {"reference_check": check}})
    assert off.reward.reference_weight == 0.0 and cfg.reward.reference_weight == 1.0
    assert said == [
        "reference tie-breaker checked: off, the reward alone ranks (its favourite scale x1.5 "
        "scores 0.200 (SE 0.050) below the reward's choice on the training prompts)"
    ]
    kept = _checked_tie_breaker(
        cfg, Say(), {"scale_baseline": {"reference_check": {**check, "agrees": True}}}
    )
    assert kept is cfg and said[-1].startswith("reference tie-breaker checked: kept")
    assert _checked_tie_breaker(cfg, Say(), {"scale_baseline": {"factor": 2.0}}) is cfg
