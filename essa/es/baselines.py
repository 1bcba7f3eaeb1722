"""A fresh ESSA run's start: the SFT adapter's held-out score and the no-search baseline.

Both run before the search and never feed back into it, except that the search may start at
the no-search baseline's factor (``optimizer.start: scale_baseline``) and that a budgeted run
re-makes its plan on the measured cost of each pass (essa.es.budget).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from essa.config import PythonToolConfig, RewardConfig
from essa.es.references import check_references
from essa.rewards.base import Reward
from essa.types import AdapterVector

if TYPE_CHECKING:
    from essa.adapters.svd import SVDAdapter
    from essa.es.checks import Checks
    from essa.es.plan import PlanInputs


def fresh_state(
    inputs: PlanInputs,
    reward_cfg: RewardConfig,
    tools: PythonToolConfig,
    checks: Checks,
    adapter: SVDAdapter,
    train_prompts: list[str],
    reward: Reward,
) -> dict[str, Any]:
    """Fresh-run state: the SFT adapter's held-out accuracy and the no-search baseline (and,
    in a budgeted run, the plan re-made with each pass's measured cost)."""
    h, budget, task = checks.h, checks.budget, checks.task
    start = time.perf_counter()
    state: dict[str, Any] = {
        "baseline_accuracy": checks.heldout(np.zeros(adapter.dim), "held-out baseline", -1),
        "best_fitness": None,
        "best_vector": None,
        "elapsed": 0.0,
    }
    seconds = time.perf_counter() - start
    budget.remeasure(inputs, h, seconds, len(task.test), len(task.train))
    if budget.plan is not None:
        state["plan"] = budget.plan.as_dict()
    if inputs.evaluation.use_scale_baseline or inputs.optimizer.start == "scale_baseline":
        state["scale_baseline"] = _scale_baseline(
            inputs, reward_cfg, tools, checks, adapter, train_prompts, reward
        )
        if budget.plan is not None:
            state["plan"] = budget.plan.as_dict()
    return state


def _scale_baseline(
    inputs: PlanInputs,
    reward_cfg: RewardConfig,
    tools: PythonToolConfig,
    checks: Checks,
    adapter: SVDAdapter,
    train_prompts: list[str],
    reward: Reward,
) -> dict[str, Any] | None:
    """The no-search baseline (essa.es.start.scale_baseline), then the search re-sized at its
    measured cost per row (its held-out pass, where it reports one, not counted)."""
    from essa.es.start import scale_baseline, scale_rows

    h, budget, task = checks.h, checks.budget, checks.task
    n = budget.start_prompts
    rows = scale_rows(task.train, h.comm.rank, h.comm.world_size, n)
    # A budgeted run reports the chosen factor's held-out score only when asked to.
    report = budget.plan is None or inputs.evaluation.use_scale_baseline
    held_out = Timed(lambda x: checks.heldout(x, "scale baseline held-out"))
    samples = inputs.generation.samples_per_prompt
    start = time.perf_counter()
    with h.phase("scale baseline", rows, unit="rows") as bar:
        result = scale_baseline(
            checks.evaluator,
            adapter,
            task.train,
            train_prompts,
            reward,
            inputs.run.seed,
            held_out if report else None,
            progress=bar.advance,
            samples=samples,
            comm=h.comm,
            prompts_used=n,
            references=check_references(tools, reward_cfg, task.train),
            reference_weight=reward_cfg.reference_weight,
        )
    seconds = time.perf_counter() - start - held_out.seconds
    generated = rows * samples
    budget.remeasure_search(inputs, h, seconds, generated, len(task.test), len(task.train))
    return result


def baseline_record(
    state: dict[str, Any], dim: int, memory: dict[str, float | int]
) -> dict[str, Any]:
    """metrics.jsonl's first line: the SFT adapter's held-out accuracy (generation -1)."""
    accuracy = state["baseline_accuracy"]
    return {
        "generation": -1,
        "event": "baseline",
        "dim": dim,
        "heldout_accuracy": accuracy,
        **memory,
    }


class Timed:
    """A held-out pass that adds up its own seconds (the scaled start's rows are timed
    without it)."""

    def __init__(self, heldout: Callable[[AdapterVector], float]) -> None:
        self.heldout = heldout
        self.seconds = 0.0

    def __call__(self, x: AdapterVector) -> float:
        start = time.perf_counter()
        try:
            return self.heldout(x)
        finally:
            self.seconds += time.perf_counter() - start
