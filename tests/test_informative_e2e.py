"""data.selection (GRESO) and data.hints (Scaf-GRPO) through `essa train` on the demo model.

A 28-item local task with a revisit-heavy split (16 training prompts, 6 or 4 drawn per step) so
histories build up in a few steps; every fourth item has an unreachable answer, so its visits
score zero for every candidate and hints must fire. Kills are placed by ESSA_FAULT (the run
kills itself inside a checkpoint write), never by a sleep.
"""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import GRPO_SETS
from tests.test_mpi import assert_same_adapter, needs_mpi
from tests.test_mpi import train as mpi_train
from tests.test_train_e2e import adapter_tensors, essa, sets

ON = ["data.selection.name=greso", "data.hints.after=1", "data.hints.format=({hint}){question}"]
RECIPES = {
    "essa": ["data.batch_size=6", "optimizer.population_size=4"],
    "grpo": [
        *GRPO_SETS,
        "grpo.lr_schedule=constant",  # a schedule over run.generations differs across lengths
    ],
}
INFORMATIVE_KEYS = (
    "prompts_skipped",
    "rows_saved",
    "zero_spread_fraction",
    "prompts_hinted",
    "explore_easy",
    "explore_hard",
)


def task_file(tmp_path: Path) -> Path:
    """28 ``a+b=`` items with a spaced-digit solution; every fourth answer is unreachable."""
    rng = random.Random(0)
    path = tmp_path / "task.jsonl"
    with path.open("w") as f:
        for i in range(28):
            a, b = rng.randint(10, 49), rng.randint(10, 49)
            answer = str(a + b) if i % 4 else "999"
            item = {"question": f"{a}+{b}=", "answer": answer, "solution": " ".join(answer)}
            f.write(json.dumps(item) + "\n")
    return path


def overrides(tmp_path: Path, recipe: str, generations: int) -> list[str]:
    return [
        f"data.source={task_file(tmp_path)}",
        "data.solution_field=solution",
        "sft.steps=4",
        "data.sft_size=8",
        "data.test_size=4",
        "data.val_size=0",  # all 16 left for training: prompts are revisited
        "evaluation.every=0",
        "evaluation.use_scale_baseline=false",
        "run.show_progress=false",
        f"run.generations={generations}",
        *RECIPES[recipe],
        *ON,
    ]


def steps(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The last metrics record of each generation (a resumed run rewrites the replayed ones)."""
    out: dict[int, dict[str, Any]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["generation"] >= 0:
            out[record["generation"]] = record
    return out


def checkpoint_state(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "checkpoint.json"
    if not path.exists():
        path = run_dir / "checkpoint" / "state.json"  # the GRPO recipe's
    return json.loads(path.read_text())["informative"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_switch_on_trains_and_resumes_exactly_after_a_kill(tmp_path: Path, recipe: str) -> None:
    ref = tmp_path / "ref"
    res = essa("train", "--run-dir", str(ref), *sets(*overrides(tmp_path, recipe, 6)))
    assert res.returncode == 0, res.stderr[-3000:]
    ref_steps = steps(ref)
    assert sorted(ref_steps) == list(range(6))
    for record in ref_steps.values():
        assert all(key in record for key in INFORMATIVE_KEYS), record
        assert 0.0 <= record["zero_spread_fraction"] <= 1.0
    rows = 4 * 1 if recipe == "essa" else 4  # population x samples, or the group size
    assert all(r["rows_saved"] == r["prompts_skipped"] * rows for r in ref_steps.values())
    assert sum(r["prompts_skipped"] for r in ref_steps.values()) > 0
    assert sum(r["prompts_hinted"] for r in ref_steps.values()) > 0

    run_dir = tmp_path / "killed"
    args = sets(*overrides(tmp_path, recipe, 6))
    res = essa("train", "--run-dir", str(run_dir), *args, env={"ESSA_FAULT": "kill@3"})
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    assert not (run_dir / "summary.json").exists()
    res = essa("train", "--resume", str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = adapter_tensors(ref), adapter_tensors(run_dir)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert checkpoint_state(run_dir) == checkpoint_state(ref)
    resumed = steps(run_dir)
    assert sorted(resumed) == list(range(6))
    reward = "mean_fitness" if recipe == "essa" else "mean_reward"
    for g, record in ref_steps.items():
        for key in (*INFORMATIVE_KEYS, reward):
            assert resumed[g][key] == record[key], (g, key)


Calls = list[tuple[bool, list[str]]]  # (held-out?, prompts) of every generate call


def spy_evaluator(calls: Calls, completions: Any) -> Any:
    """ESSA's ``evaluator.completions(population, prompts, seed=None, ...)``: held-out calls
    are the unseeded ones (training draws common random numbers from a seed)."""

    def wrapped(
        population: Any, prompts: list[str], seed: int | None = None, *a: Any, **k: Any
    ) -> Any:
        calls.append((seed is None, list(prompts)))
        return completions(population, prompts, seed, *a, **k)

    return wrapped


def spy_generate_texts(calls: Calls, generate_texts: Any) -> Any:
    """GRPO's held-out ``heldout_completions(model, tokenizer, prompts, ...)`` (the one
    held-out path; rollouts sample through ``model.generate``)."""

    def wrapped(model: Any, tokenizer: Any, prompts: list[str], *a: Any, **k: Any) -> Any:
        calls.append((True, list(prompts)))
        return generate_texts(model, tokenizer, prompts, *a, **k)

    return wrapped


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_heldout_prompts_never_get_hints(
    tmp_path: Path, recipe: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import essa.backends
    from essa.config import load_config
    from essa.recipes import essa_es, grpo

    calls: Calls = []
    if recipe == "essa":
        make = essa.backends.population_evaluator

        def evaluator(*args: Any, **kwargs: Any) -> Any:
            ev = make(*args, **kwargs)
            ev.completions = spy_evaluator(calls, ev.completions)
            return ev

        monkeypatch.setattr(essa.backends, "population_evaluator", evaluator)
    else:
        import essa.backends.evaluator

        heldout = essa.backends.evaluator.heldout_completions
        monkeypatch.setattr(
            essa.backends.evaluator, "heldout_completions", spy_generate_texts(calls, heldout)
        )
    # No drift report: its retention and sampled passes would count as held-out calls.
    no_drift = ["evaluation.drift.prompts=0", "evaluation.drift.items=0"]
    cfg = load_config(None, [*overrides(tmp_path, recipe, 4), "evaluation.every=2", *no_drift])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    summary = (essa_es if recipe == "essa" else grpo).run(cfg, run_dir)
    hinted = sum(r["prompts_hinted"] for r in steps(run_dir).values())
    assert hinted > 0, "no hint fired: the test would prove nothing"
    heldout = [prompts for is_heldout, prompts in calls if is_heldout]
    # GRPO checks on the test split during training; ESSA on validation, none here (val_size 0)
    periodic = sum("heldout_accuracy" in r for r in steps(run_dir).values())
    assert (periodic > 0) == (recipe == "grpo")
    assert len(heldout) == periodic + 2  # and the baseline, the final one
    assert all(len(p) == summary["test_size"] for p in heldout)
    assert not any("(" in prompt for prompts in heldout for prompt in prompts)
    if recipe == "essa":  # the training calls did carry hints
        assert any("(" in prompt for h, prompts in calls if not h for prompt in prompts)


@pytest.mark.slow
@pytest.mark.mpi
@needs_mpi
def test_two_ranks_keep_the_same_history_as_one(tmp_path: Path) -> None:
    """ESSA under mpiexec: each rank scores its shard of candidates, the per-prompt values are
    gathered, and both ranks (so the run) skip and hint exactly as one process does."""
    args = [*overrides(tmp_path, "essa", 4), "evaluation.strategy=batched"]
    one, two = tmp_path / "one", tmp_path / "two"
    mpi_train(0, "--run-dir", str(one), sets=args)
    mpi_train(2, "--run-dir", str(two), sets=args)
    assert_same_adapter(one, two)
    assert checkpoint_state(one) == checkpoint_state(two)
    a, b = steps(one), steps(two)
    assert all(a[g][key] == b[g][key] for g in a for key in (*INFORMATIVE_KEYS, "mean_fitness"))
    assert sum(r["prompts_skipped"] for r in a.values()) > 0
