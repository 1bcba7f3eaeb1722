"""An ESSA run's start: the SFT adapter and the no-search baseline, before the search.

* on the test split (:func:`fresh_state`): the SFT adapter's held-out score and the no-search
  baseline (the SFT adapter uniformly scaled, essa.es.start), reported and never fed back,
  except that the search may start at the baseline's factor (``optimizer.start:
  scale_baseline``) and that a budgeted run re-makes its plan on each pass's measured cost;
* on the validation split (:func:`open_watch`): the SFT adapter's per-item scores, the
  reference every later point is compared with; the scaled start, which the search starts
  from only where it beats the SFT adapter; the pre-flight (essa.es.watch).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from essa.config import OptimizerConfig, PythonToolConfig, RewardConfig, RunConfig
from essa.es.references import check_references
from essa.es.watch import Watch, WatchSettings, at_an_edge
from essa.rewards.base import Reward
from essa.types import AdapterVector

if TYPE_CHECKING:
    from essa.adapters.svd import SVDAdapter
    from essa.es.checks import Checks
    from essa.es.plan import PlanInputs
    from essa.harness import Harness

Validate = Callable[[AdapterVector, str], list[float]]  # (x, name) -> per-item scores


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
    zeros = np.zeros(adapter.dim)
    scores = checks.heldout_items(zeros, "held-out baseline", -1)
    state: dict[str, Any] = {
        "baseline_accuracy": float(np.mean(scores)) if scores else float("nan"),
        "baseline_scores": scores,  # the final pass's own when the run exports the SFT adapter
        "best_fitness": None,
        "best_vector": None,
        "elapsed": 0.0,
    }
    seconds = time.perf_counter() - start
    # The watch's reference, scored once: at an edge the scaled start is not tried, and the
    # pre-flight keeps the start (no search, so no drift report's parts to write first).
    start = time.perf_counter()
    state["sft_validation"] = checks.validate(zeros, "SFT adapter")
    check_seconds = time.perf_counter() - start
    budget.reference_scored = True
    kept = _kept_at_an_edge(inputs, state["sft_validation"])
    report = checks.reserve_end(seconds, searching=not kept, check_seconds=check_seconds)
    state["end_reserve"] = h.end_reserve  # a resumed run keeps it
    budget.remeasure(inputs, h, seconds, len(task.test), len(task.train), report)
    if budget.plan is not None:
        state["plan"] = budget.plan.as_dict()
    tried = _scaled_start(inputs, state["sft_validation"], h)
    if inputs.optimizer.start == "scale_baseline" and not tried:
        state["scaled_start_skipped"] = True  # at an edge: the pre-flight reads the SFT adapter
    if inputs.evaluation.use_scale_baseline or tried:
        state["scale_baseline"] = _scale_baseline(
            inputs, reward_cfg, tools, checks, adapter, train_prompts, reward
        )
        if budget.plan is not None:
            state["plan"] = budget.plan.as_dict()
    return state


def _kept_at_an_edge(inputs: PlanInputs, sft_validation: list[float]) -> bool:
    """Whether the SFT adapter is at the floor or the ceiling on validation and the run keeps
    its start there (``run.on_no_signal: keep_start``): the pre-flight then keeps it."""
    return at_an_edge(sft_validation) is not None and inputs.run.on_no_signal == "keep_start"


def _scaled_start(inputs: PlanInputs, sft_validation: list[float], h: Harness) -> bool:
    """Whether the search's scaled start is tried: ``optimizer.start: scale_baseline``, unless
    the pre-flight keeps the SFT adapter at an edge (:func:`_kept_at_an_edge`): a factor
    chosen on a reward that is nearly all 0 or all 1 is chosen on noise (x6 on a floor task)."""
    if inputs.optimizer.start != "scale_baseline":
        return False
    if not _kept_at_an_edge(inputs, sft_validation):
        return True
    h.say(
        f"scaled start not tried: the SFT adapter is at the {at_an_edge(sft_validation)} on validation"
    )
    return False


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


def searched_start(state: dict[str, Any]) -> dict[str, Any] | None:
    """The scale baseline the search starts from: None where it did not run, failed, or did
    not beat the SFT adapter on validation."""
    scale = state.get("scale_baseline")
    return None if scale is None or scale.get("validated") is False else scale


def dense_informative(reward: RewardConfig, state: dict[str, Any]) -> bool | None:
    """Whether the fitness's tie-breaker ranks where the reward cannot: it is on and its check
    found factors the reward scores higher than the reward alone found (essa.es.start); None
    where it is on but its check did not run (no scaled start tried)."""
    if reward.reference_weight and state.get("scaled_start_skipped"):
        return None
    check = (state.get("scale_baseline") or {}).get("reference_check")
    if not reward.reference_weight or not check or check.get("factor") is None:
        return False
    return bool(check["reward_with"] > check["reward_without"])


def open_watch(
    run: RunConfig,
    optimizer: OptimizerConfig,
    reward: RewardConfig,
    h: Harness,
    validate: Validate,
    adapter: SVDAdapter,
    state: dict[str, Any],
) -> Watch:
    """The run's watch: a resumed run's from its checkpointed state, a fresh run's after
    :func:`watch_start` (kept in ``state`` for the checkpoint)."""
    watch = Watch(WatchSettings.of(run), state.get("watch"))
    if "watch" not in state:
        state["watch"] = watch_start(optimizer, reward, h, watch, validate, adapter, state)
    return watch


def watch_start(
    optimizer: OptimizerConfig,
    reward: RewardConfig,
    h: Harness,
    watch: Watch,
    validate: Validate,
    adapter: SVDAdapter,
    state: dict[str, Any],
) -> dict[str, Any]:
    """A fresh run's start on validation: the SFT adapter, the scaled start (the search starts
    from it only where it beats the SFT adapter by more than its paired SE) and the pre-flight
    (essa.es.watch). Returns the watch's state, to checkpoint."""
    from essa.es.start import scale_vector

    zeros = np.zeros(adapter.dim)
    scores = (
        state["sft_validation"] if "sft_validation" in state else validate(zeros, "SFT adapter")
    )
    if not scores:
        h.say("no validation split (data.val_size 0): the search's mean is exported unchecked")
        return watch.state
    watch.observe("SFT adapter", -1, zeros, scores)
    start = watch.state["points"][0]["score"]
    start_scores = scores
    scale = searched_start(state) if optimizer.start == "scale_baseline" else None
    if scale is not None and scale["factor"] != 1.0:
        x0, name = scale_vector(adapter, scale["factor"]), f"SFT adapter x{scale['factor']:g}"
        scaled = validate(x0, name)
        fields = watch.observe(name, -1, x0, scaled)
        scale["validated"] = watch.validated()
        verdict = "there" if scale["validated"] else "at the SFT adapter"
        h.say(
            f"scaled start {name}: validation {fields['val_accuracy']:.3f} against the SFT "
            f"adapter's {start:.3f} ({fields['val_gain']:+.3f}, SE {fields['val_se']:.3f}); "
            f"the search starts {verdict}"
        )
        start_scores = scaled if scale["validated"] else scores
    line = watch.preflight(start_scores, dense_informative(reward, state))
    if line is not None:
        h.say(line)
    watch.start_search(float(np.mean(start_scores)))
    return watch.state
