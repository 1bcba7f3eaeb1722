"""optimizer.drift_budget: the anchor-set KL of every candidate in one population forward, the
fitness it shapes (penalty, budget, anchor to the SFT point) and what a run does with it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from essa.config import DriftBudgetConfig
from essa.drift.models import PopulationModels
from essa.drift.offtask import offtask_kl
from essa.es.drift_budget import anchor_set, population_kl, shape
from tests.conftest import svd_setup
from tests.test_train_e2e import essa, sets

PROMPTS = ["12+3=", "7*8=", "45-6=", "9 9 9", "1="]


def test_population_kl_is_the_drift_reports_kl_row_by_row(tiny_model_dir: Path) -> None:
    """Each candidate's anchor-set KL is what the drift report measures for that vector alone
    (the same positions, the same formula), whatever the chunking of the population."""
    base, tokenizer, adapter = svd_setup(tiny_model_dir)
    rng = np.random.default_rng(0)
    population = np.stack(
        [np.zeros(adapter.dim)]
        + [s * adapter.stds() * rng.standard_normal(adapter.dim) for s in (0.2, 0.5, 1.0)]
        + [-adapter.stds()]
    )  # (5, D): the SFT point, three random moves and every singular value at zero (the base)
    anchors = anchor_set(base, tokenizer, PROMPTS, 6, micro_batch_size=8)
    together = population_kl(base, adapter, anchors, population, micro_batch_size=64)
    chunked = population_kl(base, adapter, anchors, population, micro_batch_size=len(PROMPTS))
    np.testing.assert_allclose(together, chunked, rtol=1e-5)
    for vector, kl in zip(population, together, strict=True):
        alone = offtask_kl(PopulationModels(base, tokenizer, adapter, vector, 8), PROMPTS, 6, 8)
        assert alone["kl_positions"] == anchors.positions
        assert kl == pytest.approx(alone["kl_base"], rel=1e-4)
    assert together[0] > 1e-3  # the SFT adapter itself is off the base
    assert together[4] < 1e-9  # no adapter left: the base model itself
    assert len(set(together.round(9))) == 5  # each row carried its own candidate


def test_a_budget_in_units_of_the_sft_adapter_is_measured_on_the_anchor_set(
    tiny_model_dir: Path,
) -> None:
    """kl_budget_sft: r: the search's budget is r x the SFT adapter's own anchor-set KL, and the
    run's line says both."""
    from essa.config import DataConfig
    from essa.es.drift_budget import drift_budget

    base, tokenizer, adapter = svd_setup(tiny_model_dir)
    d = DriftBudgetConfig(kl_budget_sft=1.25, prompts=4, tokens=6)
    budget = drift_budget(d, DataConfig(), 8, base, tokenizer, adapter)
    assert budget is not None and budget.anchor_set is not None
    sft = float(budget.kl(np.zeros((1, adapter.dim)))[0])
    assert sft > 1e-3 and budget.config.kl_budget == pytest.approx(1.25 * sft)
    line = budget.describe()
    assert f"KL budget {1.25 * sft:.4g} (1.25x the SFT adapter's)" in line
    assert "over it" not in line  # r >= 1: the SFT adapter is within


def test_penalty_budget_and_anchor_shape_the_fitness() -> None:
    population = np.array([[0.0, 0.0], [1.0, 0.0], [2.0, 2.0], [0.0, 1.0]])  # (4, D=2)
    fitness = np.array([0.5, 0.8, 0.9, np.nan])
    kl = np.array([0.1, 0.3, 0.6, 0.2])
    scale = np.array([1.0, 0.0])  # the second coordinate is not searched: no anchor term
    off, metrics = shape(fitness, population, DriftBudgetConfig(), scale, None)
    np.testing.assert_array_equal(off, fitness)
    assert metrics == {}
    penal, metrics = shape(fitness, population, DriftBudgetConfig(kl_penalty=1.0), scale, kl)
    np.testing.assert_allclose(penal[:3], [0.4, 0.5, 0.3])
    assert np.isnan(penal[3])  # a failed evaluation stays failed
    assert metrics["anchor_kl_mean"] == pytest.approx(0.3)
    # Budget 0.25: the two candidates over it rank below the one within it, by their excess.
    ranked, metrics = shape(fitness, population, DriftBudgetConfig(kl_budget=0.25), scale, kl)
    assert metrics["over_kl_budget"] == 2.0
    assert ranked[0] > ranked[1] > ranked[2]
    assert ranked[0] == 0.5
    anchored, metrics = shape(fitness, population, DriftBudgetConfig(anchor=0.5), scale, None)
    # 0.5 * mean over the searched coordinates (the first only) of (x / s)^2
    np.testing.assert_allclose(anchored[:3], [0.5, 0.8 - 0.5, 0.9 - 2.0])
    assert metrics["anchor_penalty_mean"] == pytest.approx((0.5 + 2.0) / 4)


def test_every_candidate_over_the_budget_ranks_by_its_kl() -> None:
    population = np.zeros((3, 1))
    ranked, _ = shape(
        np.array([0.9, 0.1, 0.5]), population, DriftBudgetConfig(kl_budget=0.01), np.ones(1),
        np.array([0.3, 0.1, 0.2]),
    )  # fmt: skip
    assert list(np.argsort(-ranked)) == [1, 2, 0]


SMALL = [
    "sft.steps=6",
    "data.sft_size=16",
    "data.test_size=16",
    "data.batch_size=8",
    "optimizer.population_size=4",
    "evaluation.every=0",
    "run.show_progress=false",
    "run.generations=3",
    "evaluation.drift.items=0",
]


def final_record(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
def test_a_run_logs_the_drift_budget_and_the_anchor_pulls_toward_sft(tmp_path: Path) -> None:
    """With a tight KL budget every generation reports its over-budget candidates; a strong
    anchor leaves the search's update smaller than the same run without it."""
    runs = {}
    for name, extra in {
        "free": [],
        "kl": ["optimizer.drift_budget.kl_budget=1e-6", "optimizer.drift_budget.kl_penalty=0.5"],
        "anchor": ["optimizer.drift_budget.anchor=100"],
    }.items():
        run_dir = tmp_path / name
        res = essa("train", "--run-dir", str(run_dir), *sets(*SMALL, *extra))
        assert res.returncode == 0, res.stderr[-3000:]
        runs[name] = (res, run_dir)
    res, run_dir = runs["kl"]
    assert "drift budget: anchor set" in res.stdout and "KL budget 1e-06" in res.stdout
    assert "(the SFT adapter is over it)" in res.stdout
    records = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"anchor_kl_mean"' in line
    ]
    assert len(records) == 3
    assert all(r["over_kl_budget"] == 4 and r["anchor_kl_mean"] > 0 for r in records)
    assert "drift budget" not in runs["free"][0].stdout

    def search_update(name: str) -> float:
        return final_record(runs[name][1])["drift"]["update"]["search"]["mean"]

    assert search_update("anchor") < search_update("free")


@pytest.mark.parametrize(
    ("sets_", "message"),
    [
        (["optimizer.drift_budget.kl_penalty=-1"], "optimizer.drift_budget.kl_penalty: must be >= 0"),
        (["optimizer.drift_budget.kl_budget=0"], "optimizer.drift_budget.kl_budget: must be > 0"),
        (["optimizer.drift_budget.kl_budget_sft=-1"],
         "optimizer.drift_budget.kl_budget_sft: must be > 0"),
        (["optimizer.drift_budget.kl_budget=0.1", "optimizer.drift_budget.kl_budget_sft=1.25"],
         "optimizer.drift_budget: kl_budget and kl_budget_sft both set"),
        (["optimizer.drift_budget.kl_budget_sft=1.25", "backend=vllm"],
         "optimizer.drift_budget: kl_penalty and kl_budget teacher-force"),
        (["optimizer.drift_budget.prompts=0"], "optimizer.drift_budget.prompts: must be >= 1"),
        (["optimizer.drift_budget.anchor=1", "algorithm=grpo"],
         "optimizer.drift_budget: shapes ESSA's fitness; algorithm grpo"),
        (["optimizer.drift_budget.decay=0.1", "algorithm=grpo"],
         "optimizer.drift_budget: decays ESSA's search mean toward its start; algorithm grpo"),
    ],
)  # fmt: skip
def test_bad_drift_budgets_fail_in_one_line(sets_: list[str], message: str) -> None:
    from essa.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, sets_)
