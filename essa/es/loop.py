"""ESSA's generation on every rank: ask, evaluate on the shared prompts, tell.

The population (P, D) is identical on every rank; each rank evaluates its shard of it on the
generation's shared prompt mini-batch and the (P,) fitness is all-gathered
(essa.es.generation.shard_fitness), so every rank tells its optimizer the same and holds the
same state after it (checked). What else a generation reads sits behind its own seam: the
informative prompts (essa.data.selection), the tie-breaker's references (essa.es.references),
the drift budget (essa.es.drift_budget).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from essa.dist import Comm
from essa.es.generation import (
    check_generation,
    fault_counts,
    fault_delta,
    generation_record,
    shard_fitness,
    tool_metrics,
    track_best,
)
from essa.es.optimizer import tell
from essa.es.settings import RunSettings
from essa.protocols import Evaluator, Optimizer
from essa.rewards.base import Reward
from essa.types import Example, Fitness, Population

if TYPE_CHECKING:
    from essa.data.selection import Informative
    from essa.es.budget import Budget
    from essa.es.drift_budget import DriftBudget
    from essa.harness import Harness, Phase


@dataclass
class Search:
    """What every generation of the search reads, and the run's checkpointed ``state`` that it
    keeps current (the best candidate, the informative prompts' history, the plan)."""

    settings: RunSettings
    opt: Optimizer
    evaluator: Evaluator
    reward: Reward
    train: list[Example]
    train_prompts: list[str]  # train rendered in data.template
    comm: Comm
    state: dict[str, Any]
    informative: Informative | None = None  # data.selection / data.hints; None: both off
    references: list[str | None] | None = None  # the tie-breaker's per item; None: the answers
    drift: DriftBudget | None = None  # optimizer.drift_budget; None: off
    # Prompts per generation: the planned ones, re-sized once after the first generation.
    prompts: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompts = self.settings.data.batch_size

    def generation(self, g: int, rows: Callable[[int], Phase] | None = None) -> dict[str, Any]:
        """Generation ``g``: ask, evaluate, tell; its metrics record. ``rows``: the progress
        bar of the generation's rows."""
        from essa.dist import check_replicas

        start = time.perf_counter()
        bytes_before, tokens_before = self.comm.comm_bytes, self.evaluator.stats.new_tokens
        # Tool counts from earlier held-out passes are not this generation's.
        tool_metrics(self.evaluator)
        population = self.opt.ask()  # (P, D), identical on every rank
        fitness, pool, faults = self.evaluate(g, population, rows)  # (P,)
        opt_metrics = tell(self.settings.optimizer, self.opt, population, fitness, pool)
        check_replicas(self.comm, self.opt, g)  # every rank must now hold the same state
        tokens = self.evaluator.stats.new_tokens - tokens_before
        seconds = time.perf_counter() - start
        record = generation_record(g, fitness, opt_metrics, seconds, tokens, self.evaluator)
        record.update(
            world_size=self.comm.world_size, comm_bytes=self.comm.comm_bytes - bytes_before
        )
        record.update(faults)
        record.update(pool)  # majority_share, answered_share under pool: population
        record.update(tool_metrics(self.evaluator))  # tool_calls_per_row, ... with tools.python
        if self.informative is not None:  # prompts_skipped, rows_saved, prompts_hinted, ...
            record.update(self.informative.end_step())
            self.state["informative"] = self.informative.state_dict()
        track_best(self.state, population, fitness)
        self.state["search_seconds"] = self.state.get("search_seconds", 0.0) + record["seconds"]
        return record

    def evaluate(
        self,
        g: int,
        population: Population,
        rows: Callable[[int], Phase] | None = None,
    ) -> tuple[Fitness, dict[str, Any], dict[str, int]]:
        """The (P,) fitness of ``population`` on generation ``g``'s shared prompts, shaped by the
        drift budget; the pool's metrics and the generation's fault counts. A generation whose
        every candidate failed stops the run before anything is told."""
        settings = self.settings.fitness(self.prompts)
        faults_before = fault_counts(self.reward, self.evaluator)
        fitness, pool = shard_fitness(
            settings, g, population, self.evaluator, self.train, self.train_prompts,
            self.reward, self.comm, rows, self.informative, self.references,
        )  # fmt: skip
        faults = fault_delta(faults_before, fault_counts(self.reward, self.evaluator))
        check_generation(g, fitness, faults, self.reward.name)
        if self.drift is not None:  # optimizer.drift_budget: KL penalty, budget, anchor
            fitness, shaped = self.drift.apply(population, fitness, self.comm)
            pool = {**pool, **shaped}
        return fitness, pool, faults

    def resize_prompts(self, h: Harness, budget: Budget, seconds: float) -> None:
        """After the search's first generation (``seconds``): the prompts per generation that the
        plan re-sizes on the search's own rows, up to the configured ones (no plan: unchanged);
        the new plan goes into ``state``."""
        batch = self.settings.configured_prompts
        most = min(batch, len(self.train))
        resized = budget.resize_prompts(h, seconds, 1, self.settings.run.generations, most, batch)
        if resized is not None:
            self.prompts, self.state["plan"] = resized.prompts, resized.as_dict()


def shown(record: dict[str, Any]) -> dict[str, Any]:
    """The loop's console fields."""
    fields = {"fitness mean": record["mean_fitness"], "best": record["best_fitness"]}
    if "signal" in record:
        fields["signal"] = record["signal"]
    if "val_accuracy" in record:
        fields["val"] = record["val_accuracy"]
    return fields
