"""The search's settings, fixed once before its first generation and read by the loop.

Two things adjust the configured sections before the search starts:

* the budget plan (essa.es.budget; none without ``run.max_wall_seconds``) sets the candidates and
  the prompts per generation; the search's first generation may re-size the prompts once more
  (:meth:`essa.es.loop.Search.resize_prompts`), the only size that changes mid-search;
* the scale baseline's check of the reference tie-breaker (essa.es.start.reference_check) turns
  the tie-breaker off where the fitness with it picks factors the reward rates lower than the
  reward alone does.

:class:`RunSettings` holds the sections with both applied; nothing rebinds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from essa.config import (
    DataConfig,
    EvaluationConfig,
    GenerationConfig,
    OptimizerConfig,
    RewardConfig,
    RunConfig,
)
from essa.es.generation import FitnessSettings

if TYPE_CHECKING:
    from essa.es.plan import Plan, PlanInputs


@dataclass(frozen=True)
class RunSettings:
    """The sections the search reads, as planned and checked before its first generation."""

    run: RunConfig  # seed, generations, the stop's patience and signal
    optimizer: OptimizerConfig  # population_size: the plan's candidates per generation
    data: DataConfig  # batch_size: the plan's prompts per generation when the search starts
    generation: GenerationConfig  # max_new_tokens resolved; samples per prompt
    reward: RewardConfig  # reference_weight: 0 where the tie-breaker's check dropped it
    evaluation: EvaluationConfig  # every: the validation checks' schedule; select: the export
    configured_prompts: int  # data.batch_size as configured: the plan re-sizes prompts up to it

    @classmethod
    def planned(
        cls,
        inputs: PlanInputs,
        reward: RewardConfig,
        plan: Plan | None,
        say: Callable[[str], None],
        state: dict[str, Any],
    ) -> RunSettings:
        """``inputs``' sections with ``plan`` applied and ``reward``'s tie-breaker as checked in
        ``state`` (the check's line goes to ``say``)."""
        optimizer, data = apply_plan(inputs.optimizer, inputs.data, plan)
        checked = checked_reward(reward, say, state)
        evaluation = inputs.evaluation
        if plan is not None and plan.every:  # the plan's checks spread over its generations
            evaluation = dataclasses.replace(evaluation, every=plan.every)
        return cls(
            inputs.run,
            optimizer,
            data,
            inputs.generation,
            checked,
            evaluation,
            configured_prompts=inputs.data.batch_size,
        )

    def fitness(self, prompts: int) -> FitnessSettings:
        """What a generation's fitness reads, on ``prompts`` shared prompts."""
        r = self.reward
        k = self.generation.samples_per_prompt
        return FitnessSettings(self.run.seed, prompts, k, r.reference_weight, r.reference_signal)

    @property
    def rows_per_prompt(self) -> int:
        """Rows one visit of a prompt generates: candidates x samples."""
        return self.optimizer.population_size * self.generation.samples_per_prompt


def apply_plan(
    optimizer: OptimizerConfig, data: DataConfig, plan: Plan | None
) -> tuple[OptimizerConfig, DataConfig]:
    """The sections with the plan's candidates and prompts per generation (the other sizes are
    read from the plan where they are used); the sections themselves without a plan."""
    if plan is None:
        return optimizer, data
    return (
        dataclasses.replace(optimizer, population_size=plan.population),
        dataclasses.replace(data, batch_size=plan.prompts),
    )


def checked_reward(
    reward: RewardConfig, say: Callable[[str], None], state: dict[str, Any]
) -> RewardConfig:
    """``reward`` with the tie-breaker off (reference_weight 0) when, on the scale baseline's
    factors, the fitness with it picks factors the reward rates lower than the reward alone
    does (essa.es.start.reference_check); one line says which. The check is in the
    checkpointed state, so a resumed run decides the same."""
    check = (state.get("scale_baseline") or {}).get("reference_check")
    if check is None or check["factor"] is None:
        return reward
    line = (
        f"factors chosen on half the training prompts score {check['reward_with']:.3f} on "
        f"the other half with it, {check['reward_without']:.3f} by the reward alone"
    )
    if check["agrees"]:
        say(f"reference tie-breaker checked: kept ({line})")
        return reward
    say(f"reference tie-breaker checked: off, the reward alone ranks ({line})")
    return dataclasses.replace(reward, reference_weight=0.0)
