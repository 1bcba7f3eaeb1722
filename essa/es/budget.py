"""An ESSA run's budget plan at run time: made before SFT, re-made after the held-out baseline,
kept in the checkpoint (essa.es.plan holds the sizing itself).

Under MPI every rank probes, the slowest rank's cost is agreed (an all-gather of one float),
and every rank computes the same plan from it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from essa.config import DataConfig, RunConfig

if TYPE_CHECKING:
    from essa.data.task import Task
    from essa.es.plan import Costs, Plan, PlanInputs, TaskLengths
    from essa.gradient.sft import SFTLimit
    from essa.harness import Harness

PLAN_NAME = "plan.json"


@dataclass
class Budget:
    """The run's plan, or none (no run.max_wall_seconds, run.plan off, or the vLLM backend)."""

    plan: Plan | None = None
    lengths: TaskLengths | None = None
    sft_step: float = 0.0
    prefill_token: float = 0.0  # the probe's, kept for the re-plan (the drift budget's forward)
    row: float = 0.0  # the last measured cost of a held-out row (the held-out checks' price)
    probe_row: float = 0.0  # the probe's cost of a row (base model, micro-batch of 16)
    val_items: int | None = None  # the validation split's items (what the checks score)
    reference_scored: bool = False  # the SFT adapter's validation scores are taken: keep their size
    report: float = 0.0  # the drift report's forecast seconds (after the held-out baseline)

    @classmethod
    def start(
        cls,
        cfg: PlanInputs,
        h: Harness,
        resume: bool,
        lengths: TaskLengths,
        model: Any,
        tokenizer: Any,
        task: Task,
        train_prompts: list[str],
    ) -> Budget:
        """Probe and plan before SFT (print the plan); a resumed run re-reads its plan."""
        from essa.es.plan import Costs, make_plan, probe_costs

        if not planned(cfg.run, cfg.backend):
            return cls(lengths=lengths)
        saved = h.run_dir / PLAN_NAME
        if resume and saved.is_file():
            # Its plan is made: only a fresh run re-plans (and reads val_items).
            return cls.resumed(json.loads(saved.read_text()), lengths)
        with h.phase("budget probe"):
            probed = probe_costs(model, tokenizer, train_prompts, cfg, h.elapsed, lengths)
            row = _slowest(h, probed.row)
            costs = Costs(
                row=row,
                sft_step=_slowest(h, probed.sft_step),
                spent=h.elapsed,
                prefill_token=_slowest(h, probed.prefill_token),
            )
            sft_done = (h.run_dir / "sft_adapter" / "adapter_config.json").exists()
            plan = make_plan(
                cfg,
                costs,
                test_items=len(task.test),
                train_items=len(task.train),
                world_size=h.comm.world_size,
                lengths=lengths,
                done=("SFT",) if sft_done else (),
                val_items=len(task.val),
            )
        budget = cls(plan, lengths, costs.sft_step, costs.prefill_token, costs.row, costs.row)
        budget.val_items = len(task.val)
        budget.announce(h, "")
        return budget

    @classmethod
    def resumed(cls, saved: dict[str, Any], lengths: TaskLengths) -> Budget:
        """The budget of a resumed run from its plan.json: the plan and the costs measured
        before the kill, so that a run resumed before its first checkpoint re-plans on them
        (with none it would price SFT steps, the KL forward and the probe's row at 0 s)."""
        from essa.es.plan import plan_from_dict

        plan = plan_from_dict(saved)
        c = plan.costs
        row = c.get("row", 0.0)
        sft_step, prefill = c.get("sft_step", 0.0), c.get("prefill_token", 0.0)
        budget = cls(plan, lengths, sft_step, prefill, row, c.get("probe_row", row))
        budget.report = c.get("report", 0.0)
        return budget

    def sft_limit(self, d: DataConfig, tokenizer: Any, task: Task) -> SFTLimit | None:
        """SFT's time limit and loss check (training examples the search also draws from,
        never held-out ones); None without a plan."""
        if self.plan is None:
            return None
        from essa.data.task import render_prompts
        from essa.es.plan import SFT_CHECK_ITEMS, SFT_CHECKS, SFT_PATIENCE
        from essa.gradient.sft import SFTLimit

        check = task.train[:SFT_CHECK_ITEMS]
        prompts = render_prompts(check, d.template, tokenizer, d.system_prompt)
        return SFTLimit(self.plan.sft_seconds, check, prompts, SFT_CHECKS, SFT_PATIENCE)

    def remeasure(
        self,
        cfg: PlanInputs,
        h: Harness,
        seconds: float,
        test_items: int,
        train_items: int,
        report: float = 0.0,
    ) -> None:
        """Re-plan what follows the held-out baseline with that pass's cost per row (the
        population machinery on the SFT adapter, at the run's micro-batch) and the drift
        report's forecast ``report`` seconds."""
        if self.plan is None or not test_items:
            return
        from essa.dist import shard
        from essa.es.plan import Costs

        part = shard(test_items, h.comm.rank, h.comm.world_size)
        row = _slowest(h, seconds / max(1, part.stop - part.start))
        self.report = _slowest(h, report)
        costs = Costs(row, self.sft_step, h.elapsed, self.prefill_token, report=self.report)
        done = ("model load", "SFT", "held-out baseline")
        self._replan(cfg, h, costs, done, test_items, train_items, "the held-out baseline")

    def remeasure_search(
        self,
        cfg: PlanInputs,
        h: Harness,
        seconds: float,
        rows: int,
        test_items: int,
        train_items: int,
    ) -> None:
        """Re-size the search before its optimizer exists, at the dearest row measured so far:
        the scaled start's (candidates on training prompts, with the reference tie-breaker),
        the held-out baseline's or the probe's. The candidates per generation are fixed from
        here on, so they are sized conservatively; the prompts are re-sized on the search's
        own first generation (:meth:`resize_prompts`). Measured: on chain_sum a search row
        cost 1.3-1.5x a held-out row and about the scaled start's; on number_format 1.26x the
        scaled start's and 0.98x the probe's."""
        if self.plan is None or not rows:
            return
        from essa.es.plan import Costs

        search_row = max(_slowest(h, seconds / rows), self.row, self.probe_row)
        costs = Costs(
            self.row,
            self.sft_step,
            h.elapsed,
            self.prefill_token,
            search_row=search_row,
            report=self.report,
        )
        done = ("model load", "SFT", "held-out baseline", "scale baseline")
        self._replan(cfg, h, costs, done, test_items, train_items, "the scaled start")

    def resize_prompts(
        self, h: Harness, seconds: float, done: int, generations: int, most: int, batch: int
    ) -> Plan | None:
        """After the search's first generation (``seconds``, the slowest rank's), the prompts
        per generation that let the target generations fit in what is left of the budget
        (held-out checks still to come taken off); the new plan, or None when nothing
        changes or the run has no plan."""
        if self.plan is None:
            return None
        from essa.es.plan import MIN_SECONDS, TARGET_GENERATIONS, resized_prompts

        p = self.plan
        seconds = max(MIN_SECONDS, _slowest(h, seconds))
        # A first generation that ended past the budget leaves nothing, never less: the plan
        # then holds the generations done, and the loop stops on its own budget check.
        after = sum(p.seconds.get(k, 0.0) for k in ("held-out", "final held-out", "drift"))
        remaining = max(0.0, p.budget - h.elapsed - after)
        left = min(TARGET_GENERATIONS, generations) - done
        prompts = resized_prompts(p.prompts, seconds, remaining, left, most, batch)
        if prompts == p.prompts:
            return None
        per_generation = seconds * prompts / p.prompts
        planned = min(generations, int(remaining / per_generation) + done)
        search = {**p.seconds, "generations": round(planned * per_generation, 1)}
        self.plan = dataclasses.replace(p, prompts=prompts, generations=planned, seconds=search)
        h.say(
            f"plan: {prompts} prompts per generation from now on, was {p.prompts} (a "
            f"generation took {seconds:.1f} s; {self.plan.generations} generations fit)"
        )
        self._record(h)
        return self.plan

    def _replan(
        self,
        cfg: PlanInputs,
        h: Harness,
        costs: Costs,
        done: tuple[str, ...],
        test_items: int,
        train_items: int,
        measured_on: str,
    ) -> None:
        from essa.es.plan import make_plan

        assert self.plan is not None
        first = self.plan.seconds  # what was planned for the phases already run stays
        plan = make_plan(
            cfg,
            costs,
            test_items=test_items,
            train_items=train_items,
            world_size=h.comm.world_size,
            lengths=self.lengths,
            done=done,
            strict=False,
            val_items=self.val_items,
        )
        planned = {k: first[k] if k in done else v for k, v in plan.seconds.items()}
        # The scaled start's prompts were fixed when it ran, and the checks' validation items
        # when the SFT adapter's reference scores were taken: a later re-plan keeps them.
        start_prompts = self.plan.start_prompts if "scale baseline" in done else plan.start_prompts
        checks = self.plan.check_items if self.reference_scored else plan.check_items
        self.plan = dataclasses.replace(
            plan, seconds=planned, start_prompts=start_prompts, check_items=checks
        )
        self.row = costs.row
        self.announce(h, f" (re-measured on {measured_on})")

    def announce(self, h: Harness, note: str) -> None:
        """Print the plan, record it (plan.json), and give the phases their planned seconds."""
        assert self.plan is not None
        first, second = self.plan.lines()
        h.say(first + note)
        h.say(second)
        self._record(h)

    def _record(self, h: Harness) -> None:
        """Give the phases the plan's seconds and write it to plan.json."""
        from essa.rundir import atomic_write_json

        assert self.plan is not None
        h.reporter.planned.update(self.plan.seconds)
        # The probe's row goes with the plan: a resumed run prices the search at it too.
        costs = {**self.plan.costs, "probe_row": round(self.probe_row, 4)}
        self.plan = dataclasses.replace(self.plan, costs=costs)
        if h.is_root:
            atomic_write_json(h.run_dir / PLAN_NAME, self.plan.as_dict())

    def adopt(self, h: Harness, state: dict[str, Any] | None) -> Plan | None:
        """The plan whose candidates, prompts per generation and check cadence the search takes
        (None: no plan); it comes from the checkpoint on resume (so a resumed run searches as the
        uninterrupted one)."""
        from essa.es.plan import plan_from_dict

        if state is not None and state.get("plan") is not None:
            self.plan = plan_from_dict(state["plan"])
        if self.plan is not None:
            h.reporter.planned.update(self.plan.seconds)
            # The checks' cadence as planned (RunSettings.planned): the budget's forecast of
            # the steps that end in one reads it.
            h.check_every = self.plan.every or h.check_every
        return self.plan

    @property
    def items(self) -> int | None:
        """Held-out items of a check during the search (None: the whole split)."""
        return None if self.plan is None else self.plan.check_items

    @property
    def start_prompts(self) -> int:
        from essa.es.start import SCALE_PROMPTS

        return SCALE_PROMPTS if self.plan is None else max(1, self.plan.start_prompts)


def planned(run: RunConfig, backend: str) -> bool:
    """Whether this run plans its budget: ESSA on the HF backend with a wall-clock budget."""
    return bool(run.plan and run.max_wall_seconds and backend == "hf")


def _slowest(h: Harness, value: float) -> float:
    """The largest ``value`` over the ranks (every rank then plans the same)."""
    return float(np.max(h.comm.allgather_fitness(np.array([value], dtype=np.float64))))
