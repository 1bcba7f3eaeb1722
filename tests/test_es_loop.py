"""The ESSA loop's components below the recipe: the planned settings (essa.es.settings), one
generation and the prompts' re-size (essa.es.loop), the tie-breaker's references
(essa.es.references). The generation runs on the fake evaluator of tests/fakes.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from essa.config import load_config
from essa.dist import get_comm
from essa.es.budget import Budget
from essa.es.generation import FitnessSettings
from essa.es.loop import Search
from essa.es.plan import TARGET_GENERATIONS
from essa.es.references import check_references, search_references
from essa.es.settings import RunSettings
from essa.harness import Harness
from essa.optimizers import make_optimizer
from essa.protocols import RowProgress
from essa.rewards import Reward
from essa.setup import plan_inputs
from essa.types import Example, Population
from tests.fakes import FakeEvaluator
from tests.test_plan import real_cfg, real_plan

TRAIN = [Example(prompt=f"{i}+{4 - i}=", answer="4") for i in range(40)]
PROMPTS = [e.prompt for e in TRAIN]
DISAGREES = {"agrees": False, "factor": 1.5, "reward_with": 0.1, "reward_without": 0.25}


class CountingEvaluator(FakeEvaluator):
    """The fake evaluator, keeping how many prompts each call answered."""

    def __init__(self) -> None:
        super().__init__()
        self.prompts: list[int] = []

    def completions(
        self,
        population: Population,
        prompts: Sequence[str],
        seed: int | None = None,
        progress: RowProgress | None = None,
        samples: int = 1,
        *,
        greedy: bool = False,
    ) -> list[list[str]]:
        self.prompts.append(len(prompts))
        return super().completions(population, prompts, seed, progress, samples, greedy=greedy)


def exact() -> Reward:
    return Reward("exact", lambda c, a, p: [float(x == y) for x, y in zip(c, a, strict=True)])


def test_the_settings_take_the_plans_sizes_and_the_checked_tie_breaker() -> None:
    cfg = real_cfg("reward.reference_weight=1", "data.batch_size=48")
    plan = dataclasses.replace(real_plan(cfg), population=8, prompts=12)
    said: list[str] = []
    state = {"scale_baseline": {"reference_check": DISAGREES}}
    settings = RunSettings.planned(plan_inputs(cfg), cfg.reward, plan, said.append, state)
    assert (settings.optimizer.population_size, settings.data.batch_size) == (8, 12)
    assert settings.configured_prompts == 48  # the plan re-sizes prompts up to it
    assert settings.reward.reference_weight == 0.0 and cfg.reward.reference_weight == 1.0
    assert len(said) == 1 and said[0].startswith("reference tie-breaker checked: off")
    assert settings.run is cfg.run and settings.evaluation.every == plan.every  # spread
    assert dataclasses.replace(settings.evaluation, every=cfg.evaluation.every) == cfg.evaluation
    assert settings.rows_per_prompt == 8 * cfg.generation.samples_per_prompt
    assert settings.fitness(5) == FitnessSettings(
        cfg.run.seed, 5, cfg.generation.samples_per_prompt, 0.0, cfg.reward.reference_signal
    )
    plain = RunSettings.planned(plan_inputs(cfg), cfg.reward, None, said.append, {})
    assert plain.optimizer is cfg.optimizer and plain.data is cfg.data
    assert plain.evaluation is cfg.evaluation
    assert plain.reward is cfg.reward and len(said) == 1  # no check, no line


def test_the_search_draws_the_resized_prompts_after_its_first_generation(tmp_path: Path) -> None:
    """Generation 0 answers the planned prompts; once the budget re-sizes them on its seconds,
    the next generation answers the new number and the state holds the new plan."""
    cfg = real_cfg("run.show_progress=false")
    plan = real_plan(cfg)
    evaluator = CountingEvaluator()
    opt = make_optimizer("cma_es", 4, population_size=plan.population, sigma0=0.5, seed=0)
    h = Harness(cfg, tmp_path, resume=False, console=None, comm=get_comm("local"))
    h.say = lambda line: None  # type: ignore[method-assign]
    budget = Budget(plan)
    state = {"best_fitness": None, "best_vector": None, "plan": plan.as_dict()}
    settings = RunSettings.planned(plan_inputs(cfg), cfg.reward, plan, h.say, state)
    search = Search(settings, opt, evaluator, exact(), TRAIN, PROMPTS, h.comm, state)
    with h:
        first = search.generation(0)
        search.resize_prompts(h, budget, 3 * plan.budget / TARGET_GENERATIONS)
        second = search.generation(1)
    assert budget.plan is not None and budget.plan.prompts < plan.prompts
    assert evaluator.prompts == [plan.prompts, budget.plan.prompts]
    assert state["plan"] == budget.plan.as_dict()
    assert [first["generation"], second["generation"]] == [0, 1]
    assert state["best_fitness"] == max(first["best_fitness"], second["best_fitness"])
    assert state["search_seconds"] == first["seconds"] + second["seconds"]
    assert opt.generation == 2 and np.asarray(state["best_vector"]).shape == (4,)


def test_a_search_without_a_plan_keeps_its_prompts(tmp_path: Path) -> None:
    cfg = load_config(None, ["data.batch_size=6", "optimizer.population_size=4"])
    opt = make_optimizer("cma_es", 4, population_size=4, sigma0=0.5, seed=0)
    h = Harness(cfg, tmp_path, resume=False, console=None, comm=get_comm("local"))
    state = {"best_fitness": None, "best_vector": None}
    settings = RunSettings.planned(plan_inputs(cfg), cfg.reward, None, h.say, state)
    evaluator = CountingEvaluator()
    search = Search(settings, opt, evaluator, exact(), TRAIN, PROMPTS, h.comm, state)
    with h:
        search.generation(0)
        search.resize_prompts(h, Budget(), 1e9)  # no plan: nothing to re-size
        search.generation(1)
    assert evaluator.prompts == [6, 6] and "plan" not in state


def test_the_tie_breaker_reads_code_call_targets_with_tools_and_answers_without() -> None:
    train = [Example(prompt="12+30=", answer="42"), Example(prompt="1+2=", answer="3")]
    tools = load_config("configs/tools_demo.yaml", ["reward.reference_weight=1"])
    assert search_references(tools.tools.python, tools.reward, train) == [
        "(12+30)=42 42",
        "(1+2)=3 3",
    ]
    assert check_references(tools.tools.python, tools.reward, train) == [
        "(12+30)=42 42",
        "(1+2)=3 3",
    ]
    plain = load_config(None, ["reward.reference_weight=1"])
    assert search_references(plain.tools.python, plain.reward, train) is None  # the answers
    assert check_references(plain.tools.python, plain.reward, train) == ["42", "3"]
    unchecked = load_config(None, ["reward.reference_weight=1", "reward.reference_check=false"])
    assert check_references(unchecked.tools.python, unchecked.reward, train) is None
    off = load_config("configs/tools_demo.yaml")
    assert search_references(off.tools.python, off.reward, train) is None
    assert check_references(off.tools.python, off.reward, train) is None
