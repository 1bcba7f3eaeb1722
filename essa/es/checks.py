"""An ESSA run's passes over its held-out splits, and what they check.

* the test split scores a point (the SFT adapter, the scaled start, the exported point): the
  run reports it and never feeds it back;
* the validation split scores a point item by item: the run's choices (the exported point,
  the stop) read those scores (essa.es.watch); the search's mean is checked every
  ``evaluation.every`` generations and once more after the search where it ran past its last
  check;
* with ``optimizer.drift_budget.kl_budget`` the exported point is held to the budget
  (essa.es.kl_promise) and, where that moved it, validated again.

Every rank calls them and generates its shard of the split; only per-item scores are
gathered, so the scores are those of one rank (the same sum in the same order).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from essa.es.generation import heldout_texts, tool_metrics
from essa.protocols import Evaluator, Optimizer
from essa.types import AdapterVector

if TYPE_CHECKING:
    from essa.config import DataConfig
    from essa.data.task import Task
    from essa.es.budget import Budget
    from essa.es.kl_promise import KLPromise
    from essa.es.watch import Watch
    from essa.harness import Harness

DriftFigures = Callable[[AdapterVector], dict[str, Any]]  # rank 0's drift (essa.drift.report)


def val_prompts(task: Task, data: DataConfig, tokenizer: Any) -> list[str]:
    """The validation split's prompts in ``data.template``."""
    from essa.data.task import render_prompts

    return render_prompts(task.val, data.template, tokenizer, data.system_prompt)


def passes_after(
    heldout: float, report: float, check: float, latest: float | None = None, checks: int = 1
) -> float:
    """Seconds kept for the passes after the search: the exported point's final held-out pass,
    the validation checks after the search (``checks``: the last mean's, as the search stops
    between checks and the export reads that mean first; with a KL budget also the held
    point's), and the drift report. Before the search the final pass is priced as the SFT
    adapter's held-out baseline (``heldout``) and a check as its validation (``check``); once a
    mean is checked, both at that check's rate where it ran slower (``latest``): a moved mean
    can answer at greater length (fraction_simplification: the last check 11.7 s against the SFT
    adapter's 9.5 s, the final pass 56 s against 47 s).

    >>> passes_after(46.5, 83.9, 9.5)
    139.9
    >>> passes_after(46.5, 83.9, 9.5, latest=11.7)  # 57.3 + 83.9 + 11.7
    152.9
    >>> passes_after(46.5, 83.9, 9.5, latest=8.0)  # never below the start's rate
    139.9
    >>> passes_after(46.5, 83.9, 9.5, checks=2)  # a KL budget validates the held point too
    149.4
    """
    slower = max(1.0, latest / check) if latest is not None and check > 0 else 1.0
    return round(heldout * slower + report + checks * check * slower, 1)


@dataclass(frozen=True)
class Exported:
    """The point the run exports and its final held-out pass."""

    vector: AdapterVector  # (D,) offsets of the singular values
    account: dict[str, Any]  # the summary's "exported": which point and why (Watch.choice)
    heldout: float  # its score on the test split
    tools: dict[str, float]  # the final pass's tool use (empty without tools)


@dataclass(frozen=True)
class Checks:
    """The held-out and validation passes of one run, and the drift figures of a point."""

    h: Harness
    evaluator: Evaluator
    task: Task  # its test and validation splits
    test_prompts: list[str]  # task.test rendered in data.template
    val_prompts: list[str]  # task.val rendered in data.template
    budget: Budget  # its plan sizes a validation check (read at each call)
    pass_drift: DriftFigures  # a checked mean's drift figures (evaluation.drift.every_pass)
    drift_report: DriftFigures  # the exported point's drift report
    promise: KLPromise | None = None  # optimizer.drift_budget.kl_budget on the exported point
    # Writes the drift report's parts the search cannot change and returns its forecast,
    # (seconds of a test-split row, test items) -> seconds (essa.drift.report.adapter_warm)
    warm_report: Callable[[], Callable[[float, int], float]] | None = None
    # What the reserve was priced on (passes_after's heldout, report, check); {} after a resume,
    # which keeps the checkpoint's reserve.
    priced: dict[str, float] = field(default_factory=dict)

    def reserve_end(
        self, heldout_seconds: float, searching: bool = True, check_seconds: float = 0.0
    ) -> float:
        """Keep the passes after the search inside the budget (:func:`passes_after`): the
        final held-out pass (as long as this rank's held-out baseline, ``heldout_seconds``),
        a validation check of the last mean (as long as the SFT adapter's, ``check_seconds``)
        and the drift report (rank 0 writes it; the ranks agree to stop on the largest). The
        report's fixed parts are written here, only for a run that will search (``searching``:
        a start kept at the pre-flight exports the SFT adapter, whose report reads none of
        them, and checks no mean). Returns the report's forecast seconds (the plan prices them
        too)."""
        from essa.dist import shard

        h, items = self.h, len(self.task.test)
        part = shard(items, h.comm.rank, h.comm.world_size)
        row = heldout_seconds / max(1, part.stop - part.start)
        forecast = self.warm_report() if searching and self.warm_report else None
        report = forecast(row, items) if forecast else 0.0
        check = check_seconds if searching else 0.0
        self.priced.update(heldout=heldout_seconds, report=report, check=check)
        h.end_reserve = passes_after(heldout_seconds, report, check, checks=self.checks_after)
        return report

    @property
    def checks_after(self) -> int:
        """Validation checks after the search: the last mean's, and with a KL budget the held
        point's (:meth:`hold`)."""
        return 2 if self.promise is not None else 1

    def heldout(
        self,
        vector: AdapterVector,
        name: str = "held-out",
        generation: int | None = None,
        final: bool = False,
    ) -> float:
        """Test-split score of ``vector`` (never fed back); samples with ``generation``."""
        scores = self.heldout_items(vector, name, generation, final)
        return sum(scores) / len(scores) if scores else float("nan")

    def heldout_items(
        self,
        vector: AdapterVector,
        name: str = "held-out",
        generation: int | None = None,
        final: bool = False,
    ) -> list[float]:
        """:meth:`heldout`'s per-item scores, in item order."""
        from essa.dist import shard

        h, examples, prompts = self.h, self.task.test, self.test_prompts
        if not examples:
            return []
        part = shard(len(prompts), h.comm.rank, h.comm.world_size)
        with h.phase(name, part.stop - part.start, unit="rows") as bar:
            texts = heldout_texts(self.evaluator, vector, prompts[part], bar.advance)
        return h.score_items(texts, examples, prompts, part, generation, final=final, name=name)

    def validate(self, vector: AdapterVector, name: str) -> list[float]:
        """Per-item validation scores of ``vector`` (the first ``budget.items``: the plan's size
        of a check), gathered from every rank's shard in item order; they feed the run's
        choices (essa.es.watch), never the test."""
        from essa.dist import shard
        from essa.evaluation import score_heldout

        h, items = self.h, self.budget.items
        examples, prompts = self.task.val[:items], self.val_prompts[:items]
        if not examples:
            return []
        part = shard(len(prompts), h.comm.rank, h.comm.world_size)
        with h.phase(f"validation ({name})", part.stop - part.start, unit="rows") as bar:
            texts = heldout_texts(self.evaluator, vector, prompts[part], bar.advance)
        mine = score_heldout(h.metric, texts, examples[part], prompts[part])[1] if texts else []
        return h.comm.allgather_fitness(np.asarray(mine, dtype=np.float64)).tolist()

    def check_mean(self, watch: Watch, opt: Optimizer) -> dict[str, Any]:
        """The search's mean after ``opt.generation`` generations on validation: its record's
        fields (val_accuracy, val_gain, val_se, val_best)."""
        name = f"mean after generation {opt.generation}"
        start = time.perf_counter()
        scores = self.validate(opt.mean, name)
        if self.priced:  # the passes after the search, at this mean's rate where it is slower
            p = self.priced
            latest = time.perf_counter() - start
            self.h.end_reserve = passes_after(
                p["heldout"], p["report"], p["check"], latest, self.checks_after
            )
        return watch.observe(name, opt.generation - 1, opt.mean, scores)

    def after_generation(
        self, g: int, every: int, watch: Watch, opt: Optimizer, record: dict[str, Any]
    ) -> str | None:
        """After generation ``g``, every ``every`` generations: the search's mean on validation,
        its fields (and rank 0's drift figures) added to ``record``; why the search stops
        there (essa.es.watch), or None."""
        if not (self.h.due(g, every) and watch.validating):
            return None
        record.update(self.check_mean(watch, opt), **tool_metrics(self.evaluator, "val_"))
        if self.h.is_root:  # rank 0 logs the record
            record.update(self.pass_drift(opt.mean))
        return watch.stop_after_check(g)

    def export(
        self,
        watch: Watch,
        opt: Optimizer,
        select: str,
        best: list[float] | None,
        start: AdapterVector,
        sft_scores: list[float] | None = None,
    ) -> Exported:
        """The exported point: the validated one (essa.es.watch), checked against ``opt``'s
        mean, or ``best`` (the best candidate seen) with ``evaluation.select: best``, held to
        the KL budget (``start``: the search's start, where the path to it passes), and its
        final held-out pass on every rank (the SFT adapter's, ``sft_scores``, when that is the
        point: the same greedy completions again)."""
        vector = np.asarray(opt.mean)
        if select == "best" and best is not None:
            vector = np.asarray(best)
        if watch.unchecked(opt.generation):  # the search's last mean, past its last check
            self.check_mean(watch, opt)
        vector, account = watch.choice(vector)  # the validated point, or the SFT adapter
        if self.promise is not None:
            vector, account = self.hold(watch, vector, account, np.asarray(start))
        self.h.say(f"exported: {account['point']} ({account['why']})")
        if sft_scores and not np.any(vector) and self._repeats_exactly():
            self.h.say("final held-out: the SFT adapter's scores from the start (the same point)")
            final = self.h.record_pass(
                sft_scores, opt.generation, final=True, name="final held-out"
            )
            return Exported(vector, account, final, {})
        tool_metrics(self.evaluator)
        final = self.heldout(vector, "final held-out", opt.generation, final=True)
        tools = tool_metrics(self.evaluator)  # the final pass's: tool_calls_per_row, ...
        return Exported(vector, account, final, tools)

    def _repeats_exactly(self) -> bool:
        """Whether a second pass of the same point would give the same texts: the HF
        evaluator's greedy decode without tool calls (a vLLM engine's batching need not
        repeat bit for bit, and a tool-using pass is wanted for its tool figures)."""
        return hasattr(self.evaluator, "tools") and self.evaluator.tools is None

    def hold(
        self, watch: Watch, vector: AdapterVector, account: dict[str, Any], start: AdapterVector
    ) -> tuple[AdapterVector, dict[str, Any]]:
        """``vector`` held to the KL budget (essa.es.kl_promise) and the account of it; a held
        search point that no longer beats the SFT adapter on validation gives way to the SFT
        adapter, held on its own path."""
        from essa.es.kl_promise import held_account
        from essa.es.watch import beyond_se, paired_gain

        assert self.promise is not None
        searched = bool(np.any(vector))  # zeros: the SFT adapter itself
        held = self.promise.hold(vector, start if searched else vector)
        val = None
        if held.moved and searched and watch.validating:
            scores = self.validate(held.vector, "held to the KL budget")
            val = (account.get("val_accuracy", float("nan")), float(np.mean(scores)))
            gain, se = paired_gain(scores, watch.state["reference"])
            if not beyond_se(gain, se):  # holding took back what it had gained
                sft = np.zeros_like(np.asarray(vector))
                why = (f"held to the KL budget the point no longer beat the SFT adapter on "
                       f"validation (+{gain:.3f}, SE {se:.3f})")  # fmt: skip
                account = {"point": "SFT adapter", "why": why, "checked": account.get("checked")}
                held = self.promise.hold(sft, sft)
        promise = self.promise
        account = {**account, "kl_budget": held_account(held, promise.limit(), val, promise.ratio)}
        self.h.say(held_line(account["kl_budget"]))
        return held.vector, account


def held_line(k: dict[str, Any]) -> str:
    """The KL budget's line at the export.

    >>> held_line({"budget": 0.1, "kl_before": 0.05, "kl": 0.05, "path_u": 2.0, "held": True})
    "KL budget 0.1: the exported point's off-task KL(base||tuned) 0.0500 is within it"
    """
    head = f"KL budget {k['budget']:g}: the exported point's off-task KL(base||tuned)"
    if k["path_u"] >= 2.0:
        return f"{head} {k['kl_before']:.4f} is within it"
    line = (f"{head} {k['kl_before']:.4f} is over it; held at u={k['path_u']:.3f} on the path "
            f"base (0) -> start (1) -> point (2): KL {k['kl']:.4f}")  # fmt: skip
    if "val_before" in k:
        line += f"; validation {k['val_before']:.3f} -> {k['val_after']:.3f}"
    if not k["held"]:
        line += "; even the base end of the path is over the budget (unsearched singular values)"
    return line
