"""optimizer.drift_budget.kl_budget as a promise on the exported adapter: the drift report's
off-task KL(base || tuned) of what a run exports is at most the budget (essa.es.kl_promise)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from essa.drift.models import PopulationModels
from essa.drift.offtask import ContinuationCache, offtask_kl
from essa.es.kl_promise import kl_promise, path_points
from tests.conftest import svd_setup
from tests.test_drift_budget import SMALL
from tests.test_train_e2e import essa, sets


def _setup(model_dir: Path) -> tuple:
    """svd_setup with the LoRA A factors drawn from a fixed seed (PEFT draws them from the
    global generator), so the figures do not depend on which tests ran first."""
    import torch

    torch.manual_seed(0)
    return svd_setup(model_dir)


def _settings(prompts: int = 6, tokens: int = 6):  # noqa: ANN202 - a DriftSettings
    from essa import setup
    from essa.config import load_config

    s = setup.drift_settings(load_config(None, []))
    return replace(s, drift=replace(s.drift, prompts=prompts, tokens=tokens), micro_batch_size=8)


def _report_kl(s, cache, base, tokenizer, adapter, vector) -> float:  # noqa: ANN001
    """The drift report's own figure for ``vector`` (essa.drift.report's path)."""
    from essa.drift.offtask import rendered_offtask_prompts

    prompts = rendered_offtask_prompts(s.data, s.drift.prompts, tokenizer)
    models = PopulationModels(base, tokenizer, adapter, np.asarray(vector), s.micro_batch_size)
    return offtask_kl(models, prompts, s.drift.tokens, s.micro_batch_size, cache)["kl_base"]


def test_the_path_runs_from_the_base_model_through_the_start_to_the_point(
    tiny_model_dir: Path,
) -> None:
    _, _, adapter = _setup(tiny_model_dir)
    rng = np.random.default_rng(0)
    x0 = 0.3 * adapter.stds() * rng.standard_normal(adapter.dim)
    x = x0 + 0.5 * adapter.stds() * rng.standard_normal(adapter.dim)
    base_end, start, point = path_points(np.array([0.0, 1.0, 2.0]), adapter.stds(), x0, x)
    sft = adapter.delta_weights(np.zeros(adapter.dim))
    for name, w in adapter.delta_weights(base_end).items():  # no update left, up to rounding
        assert float(w.abs().max()) < 1e-6 * float(sft[name].abs().max())
    np.testing.assert_allclose(start, x0)
    np.testing.assert_allclose(point, x)


@pytest.mark.parametrize("where", ["between start and point", "between base and start"])
def test_a_point_over_the_budget_is_held_within_it_as_the_report_measures(
    tiny_model_dir: Path, where: str
) -> None:
    """The held point's KL, measured the way the drift report measures it (its own forward,
    the run's cached continuations), is within the budget, and the point moved only as far as
    it had to: no point further out on the path that was measured is within it."""
    base, tokenizer, adapter = _setup(tiny_model_dir)
    s, cache = _settings(), ContinuationCache()
    x0 = -0.5 * adapter.stds()  # a start nearer the base model than the SFT adapter
    x = 2.0 * adapter.stds() * np.random.default_rng(1).standard_normal(adapter.dim)
    start_kl = _report_kl(s, cache, base, tokenizer, adapter, x0)
    far_kl = _report_kl(s, cache, base, tokenizer, adapter, x)
    assert far_kl > 2 * start_kl > 0
    budget = (start_kl + far_kl) / 2 if where == "between start and point" else start_kl / 2
    promise = kl_promise(budget, s, cache, base, tokenizer, adapter)
    assert promise is not None
    held = promise.hold(x, x0)
    assert held.kl_before == pytest.approx(far_kl, rel=1e-4)
    assert held.moved
    if where == "between start and point":  # the start itself is within: held on its far side
        assert held.u >= 1.0
    assert _report_kl(s, cache, base, tokenizer, adapter, held.vector) <= budget
    beyond = [kl for u, kl in promise.evaluated if u > held.u]
    assert beyond and min(beyond) > budget * 0.99  # nothing further out on the path was within


def test_a_point_within_the_budget_is_left_as_it_is(tiny_model_dir: Path) -> None:
    base, tokenizer, adapter = _setup(tiny_model_dir)
    s, cache = _settings(), ContinuationCache()
    x = 0.2 * adapter.stds()
    kl = _report_kl(s, cache, base, tokenizer, adapter, x)
    promise = kl_promise(2 * kl, s, cache, base, tokenizer, adapter)
    assert promise is not None
    held = promise.hold(x, np.zeros(adapter.dim))
    assert not held.moved and held.u == 2.0
    np.testing.assert_array_equal(held.vector, x)
    assert len(promise.evaluated) == 1  # one KL pass, of the point itself


def test_a_budget_in_units_of_the_sft_adapter_is_measured_on_the_reports_set(
    tiny_model_dir: Path,
) -> None:
    """kl_budget_sft (``ratio``): B is r x the SFT adapter's report KL, measured at the first
    hold, and the held point is within it as the report measures."""
    base, tokenizer, adapter = _setup(tiny_model_dir)
    s, cache = _settings(), ContinuationCache()
    sft_kl = _report_kl(s, cache, base, tokenizer, adapter, np.zeros(adapter.dim))
    x = 2.0 * adapter.stds() * np.random.default_rng(1).standard_normal(adapter.dim)
    far_kl = _report_kl(s, cache, base, tokenizer, adapter, x)
    assert far_kl > 1.05 * sft_kl > 0
    ratio = (1.0 + far_kl / sft_kl) / 2  # a budget between the SFT adapter's KL and the point's
    promise = kl_promise(None, s, cache, base, tokenizer, adapter, ratio=ratio)
    assert promise is not None and promise.budget is None
    held = promise.hold(x, np.zeros(adapter.dim))
    assert promise.budget == pytest.approx(ratio * sft_kl, rel=1e-4)
    assert held.moved and held.u > 1.0  # the SFT adapter (u = 1) is within r >= 1 its own KL
    assert _report_kl(s, cache, base, tokenizer, adapter, held.vector) <= promise.budget


def test_no_budget_or_no_base_model_makes_no_promise(tiny_model_dir: Path) -> None:
    base, tokenizer, adapter = _setup(tiny_model_dir)
    s, cache = _settings(), ContinuationCache()
    assert kl_promise(None, s, cache, base, tokenizer, adapter) is None
    assert kl_promise(0.1, s, cache, None, tokenizer, adapter) is None  # vLLM: no HF model
    assert kl_promise(0.1, _settings(prompts=0), cache, base, tokenizer, adapter) is None


@pytest.mark.slow
def test_the_exported_adapter_keeps_the_promise_and_the_summary_says_how(tmp_path: Path) -> None:
    """A budget below the SFT adapter's own off-task KL: the run exports a point whose
    report KL is within it, says so in one line, and accounts for it in the summary."""
    run_dir = tmp_path / "run"
    res = essa("train", "--run-dir", str(run_dir),
               *sets(*SMALL, "optimizer.drift_budget.kl_budget=1e-4"))  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    account = summary["exported"]["kl_budget"]
    assert account["budget"] == 1e-4 and account["held"]
    assert account["path_u"] < 1.0 < account["kl_before"] / 1e-4  # held toward the base model
    assert summary["drift"]["kl_base"] <= 1e-4
    assert account["kl"] == pytest.approx(summary["drift"]["kl_base"], rel=1e-3)
    assert "KL budget 0.0001: the exported point's off-task KL(base||tuned)" in res.stdout
    assert "is over it; held at u=" in res.stdout


@pytest.mark.slow
def test_a_budget_in_units_of_the_sft_adapter_holds_on_the_report(tmp_path: Path) -> None:
    """kl_budget_sft 0.5: half the SFT adapter's own off-task KL, as the report measures it;
    the exported adapter is within it."""
    run_dir = tmp_path / "run"
    res = essa("train", "--run-dir", str(run_dir),
               *sets(*SMALL, "optimizer.drift_budget.kl_budget_sft=0.5"))  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    account, drift = summary["exported"]["kl_budget"], summary["drift"]
    assert account["budget"] == pytest.approx(0.5 * drift["kl_base_sft"], rel=1e-3)
    assert account["sft_multiple"] == 0.5
    assert account["held"] and drift["kl_base"] <= account["budget"]
    assert "(0.5x the SFT adapter's) (the SFT adapter is over it)" in res.stdout
