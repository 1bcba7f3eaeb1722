"""A run of a recipe (:class:`Harness`) and its step loop (:class:`Step`).

The harness writes the resolved config (``config.yaml``) at the start of a fresh run, keeps the
metrics log (``metrics.jsonl``, rank 0 only) and truncates it on resume, runs the step loop
(signals: :mod:`essa.harness.interrupt`; the wall-clock budget ``run.max_wall_seconds``), the
checkpoint cadence with a storage fault turned into one line, the held-out metric and its
samples, the trackers and the summary. ``Step`` lives here with ``Harness``: each reads the
other's state (the loop's bar, the last complete checkpoint).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from essa.config import Config, dump_config, to_dict
from essa.dist import Comm, any_rank
from essa.evaluation import check_heldout_answers, heldout_metric, score_heldout
from essa.harness.heldout import HELDOUT_SCORES_NAME, heldout_record
from essa.harness.interrupt import Interrupt
from essa.harness.progress import Phase, Reporter, format_value
from essa.rundir import MetricsLog, atomic_write_json, atomic_write_text, stop_on_storage_error
from essa.samples import print_samples, sample_rows, samples_log, write_samples
from essa.tracking import Trackers, make_trackers
from essa.types import Example

JSONDict = dict[str, Any]


class Harness:
    """One run of a recipe in ``run_dir`` (created and checked by the CLI beforehand).

    Under MPI every rank makes one; rank 0 alone prints and writes files.
    """

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        *,
        resume: bool,
        console: Any,
        comm: Comm,
        unit: str = "generations",
        checkpoint_every: int = 1,
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.resume = resume
        self.comm = comm
        self.is_root = comm.rank == 0
        self.unit = unit  # "generations" or "steps": what the loop counts
        self.checkpoint_every = checkpoint_every
        self.metrics = MetricsLog(run_dir / "metrics.jsonl", enabled=self.is_root)
        self.samples = samples_log(run_dir, enabled=self.is_root)
        # Every held-out pass's per-item scores (SFT start, each evaluation, final): paired
        # tests against the SFT adapter need no second evaluation.
        self.heldout_scores = MetricsLog(run_dir / HELDOUT_SCORES_NAME, enabled=self.is_root)
        self.metric_name, self.metric = heldout_metric(cfg)  # what "held-out accuracy" means
        self.reporter = Reporter(
            console if self.is_root else None,
            show_progress=cfg.run.show_progress,
            log=MetricsLog(run_dir / "phases.jsonl", enabled=self.is_root),
        )
        self.started = time.perf_counter()
        self.elapsed_before = 0.0  # training seconds of earlier processes of a resumed run
        self.interrupt = Interrupt()
        self._saved = 0  # steps held by the last complete checkpoint
        self.step_seconds: list[float] = []  # this process's steps, for the budget's forecast
        # ... and those that ended in a held-out or validation pass, every check_every steps
        # (evaluation.every; a recipe whose plan spreads its checks sets the planned cadence)
        self.check_step_seconds: list[float] = []
        self.check_every = cfg.evaluation.every
        # Seconds the passes after the loop (final held-out pass, drift report) are forecast to
        # take: the budget stop keeps them inside run.max_wall_seconds (set by the recipe once
        # measured; 0 until then).
        self.end_reserve = 0.0
        self.stop_reason: str | None = None  # why the loop ended before run.generations
        self.compute: JSONDict = {}  # device, resolved dtype, CPU capability (the summary's)
        if self.is_root and not resume:  # first, so that a kill at any later moment can resume
            atomic_write_text(run_dir / "config.yaml", dump_config(cfg))
        # After the config: wandb and trackio write under run_dir. A resumed run starts a new
        # tracker run whose steps go on from the checkpoint.
        self.trackers = (
            make_trackers(cfg.run.report_to, run_dir, to_dict(cfg)) if self.is_root else Trackers()
        )

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.trackers.close()  # flushes event files and ends wandb/trackio runs, also on errors

    # ------------------------------------------------------------------ console
    def say(self, text: str) -> None:
        self.reporter.say(text)

    def phase(
        self,
        name: str,
        total: int | None = None,
        *,
        unit: str = "",
        start: int = 0,
        log: bool = True,
    ) -> Phase:
        return self.reporter.phase(name, total, unit=unit, start=start, log=log)

    @property
    def elapsed(self) -> float:
        """Training seconds of this run so far, earlier processes of a resumed run included."""
        return self.elapsed_before + time.perf_counter() - self.started

    # ------------------------------------------------------------------ state
    def restore(self, state: JSONDict | None, *, done: int) -> JSONDict | None:
        """Adopt a loaded checkpoint (``done`` steps) or start the metrics afresh (None)."""
        if state is None:
            for log in (self.metrics, self.samples, self.heldout_scores):
                log.truncate_after(-2)
            return None
        for log in (self.metrics, self.samples, self.heldout_scores):
            log.truncate_after(done - 1)  # records past the checkpoint will be redone
        self.elapsed_before = float(state.get("elapsed", 0.0))
        self.end_reserve = float(state.get("end_reserve", 0.0))
        self._saved = done
        return state

    def log(self, record: JSONDict) -> None:
        """One metrics.jsonl record, and the same to every tracker (step: steps done)."""
        self.metrics.write(record)
        self.trackers.log(record, step=int(record["generation"]) + 1)

    # ------------------------------------------------------------------ held-out
    def check_heldout(self, examples: Sequence[Example]) -> None:
        """Refuse held-out data the metric cannot grade, before any model loads."""
        check_heldout_answers(self.metric_name, examples)

    def score(
        self,
        texts: Sequence[str],
        examples: Sequence[Example],
        prompts: Sequence[str],
        generation: int | None = None,
        *,
        final: bool = False,
        name: str = "held-out",
    ) -> float:
        """Mean held-out score of ``texts`` under ``evaluation.metric`` (rank 0's call).

        With ``generation`` (-1: the SFT baseline; the steps done for ``final``) the first
        held-out items also go to samples.jsonl, the trackers and the console, and the pass
        (``name``) to heldout_scores.jsonl.
        """
        mean, scores = score_heldout(self.metric, texts, examples, prompts)
        if generation is not None:
            self._samples(generation, final, texts, examples, scores)
            self._item_scores(generation, final, scores, name)
        return mean

    def _item_scores(
        self, generation: int, final: bool, scores: Sequence[float], name: str
    ) -> None:
        """heldout_scores.jsonl's one record format, the same for every recipe: the pass's name
        ("held-out baseline", "held-out", "scale baseline held-out", "final held-out"), the
        steps done, whether it is the final pass, the metric and the per-item scores."""
        self.heldout_scores.write(heldout_record(generation, final, self.metric_name, name, scores))

    def _samples(
        self,
        generation: int,
        final: bool,
        texts: Sequence[str],
        examples: Sequence[Example],
        scores: Sequence[float],
    ) -> None:
        """The first held-out items to samples.jsonl, the trackers and the console."""
        questions = [e.prompt for e in examples]
        answers = [e.answer for e in examples]
        rows = sample_rows(generation, questions, texts, answers, scores)
        write_samples(self.samples, rows)
        self.trackers.log_samples(rows, step=generation if final else generation + 1)
        if not final:  # the run ends on its short summary; the final samples are in the file
            print_samples(self.reporter.console, rows, self._samples_title(generation, final))

    def score_shard(
        self,
        texts: Sequence[str],
        examples: Sequence[Example],
        prompts: Sequence[str],
        part: slice,
        generation: int | None = None,
        *,
        final: bool = False,
        name: str | None = None,
    ) -> float:
        """Every rank: score its ``part`` of the held-out items (``texts`` are its completions),
        gather the per-item scores (8 bytes each), and return the mean over all items, summed
        in item order as one rank would. Rank 0's items feed the samples; every pass with a
        ``generation`` or a ``name`` goes to heldout_scores.jsonl."""
        scores = self.score_items(
            texts, examples, prompts, part, generation, final=final, name=name
        )
        return sum(scores) / len(scores) if scores else float("nan")

    def score_items(
        self,
        texts: Sequence[str],
        examples: Sequence[Example],
        prompts: Sequence[str],
        part: slice,
        generation: int | None = None,
        *,
        final: bool = False,
        name: str | None = None,
    ) -> list[float]:
        """:meth:`score_shard`'s per-item scores, gathered in item order."""
        mine = (
            [] if not texts else score_heldout(self.metric, texts, examples[part], prompts[part])[1]
        )
        scores = self.comm.allgather_fitness(np.asarray(mine, dtype=np.float64)).tolist()
        if generation is not None and self.is_root and texts:
            self._samples(generation, final, texts, examples[part], mine)
        if generation is not None or name is not None:
            self.record_pass(scores, generation, final=final, name=name)
        return scores

    def record_pass(
        self,
        scores: Sequence[float],
        generation: int | None = None,
        *,
        final: bool = False,
        name: str | None = None,
    ) -> float:
        """A held-out pass's per-item scores to heldout_scores.jsonl (rank 0); their mean."""
        step = -1 if generation is None else generation
        self._item_scores(step, final, scores, "held-out" if name is None else name)
        return sum(scores) / len(scores) if scores else float("nan")

    def _samples_title(self, generation: int, final: bool) -> str:
        """The console's words, counted as the progress lines count (steps done)."""
        if generation == -1:
            return "samples (SFT start)"
        if final:
            return f"samples (final, after {generation} {self.unit})"
        return f"samples after {self.unit[:-1]} {generation + 1}"

    # ------------------------------------------------------------------ the loop
    def steps(self, done: int, show: Callable[[JSONDict], JSONDict]) -> Iterator[Step]:
        """Yield each remaining step until ``run.generations`` are done, a signal or the budget.

        The body calls ``step.finish(record, save)``; ``show(record)`` picks the console fields.
        """
        total = self.cfg.run.generations
        loop = self.reporter.phase(self.unit, total, unit=self.unit, start=done, every=True)
        with loop as bar, self.interrupt:
            while done < total:
                step = Step(self, done, bar, show)
                yield step
                done += 1
                if step.stop_reason is not None:
                    self.stop_reason = step.stop_reason
                    self.say(step.stop_reason)
                    if step.signum is not None:
                        self.comm.barrier()  # no rank exits before rank 0's checkpoint is saved
                        raise SystemExit(128 + step.signum)
                    return

    def due(self, step: int, every: int) -> bool:
        """True after every ``every``-th step (0: never)."""
        return bool(every) and (step + 1) % every == 0

    # ------------------------------------------------------------------ summary
    def finish(self, summary: JSONDict) -> JSONDict:
        """Write summary.json and log it to the trackers; returns it (the command that ran the
        recipe prints its closing lines: essa.cli.closing_lines)."""
        atomic_write_json(self.run_dir / "summary.json", summary)
        self.trackers.log_summary(summary)
        return summary

    def summary(
        self, *, baseline: float, final: float, steps: int, adapter_dir: Path, **extra: Any
    ) -> JSONDict:
        """The summary fields every recipe reports; ``extra`` adds the recipe's own (its
        ``stop_reason`` None: the loop's own, a signal's or the budget's, if it had one)."""
        if extra.get("stop_reason") is None and self.stop_reason is not None:
            extra["stop_reason"] = self.stop_reason
        planned = self.reporter.planned
        plan_vs_actual = {
            name: {"planned": seconds, "actual": round(self.reporter.actual.get(name, 0.0), 1)}
            for name, seconds in planned.items()
        }
        return {
            **({"phases": plan_vs_actual} if planned else {}),
            "baseline_accuracy": baseline,
            "final_accuracy": final,
            "improvement": final - baseline,
            "generations": steps,
            "wall_seconds": round(self.elapsed, 2),
            "process_wall_seconds": round(time.perf_counter() - self.started, 2),
            "heldout_metric": self.metric_name,  # what the two accuracies measured
            "adapter_dir": str(Path(adapter_dir).resolve()),  # absolute: runs start anywhere
            **({"compute": self.compute} if self.compute else {}),
            **extra,
        }


class Step:
    """One step of the loop: the body computes ``record`` and hands it to :meth:`finish`."""

    def __init__(
        self, harness: Harness, index: int, bar: Phase, show: Callable[[JSONDict], JSONDict]
    ) -> None:
        self.harness = harness
        self.index = index  # steps done before this one
        self.bar = bar
        self.show = show
        self.stop_reason: str | None = None
        self.signum: int | None = None  # the signal all ranks agreed to stop for
        self.started = time.perf_counter()

    def progress(self, total: int) -> Phase:
        """A transient bar over the step's own items (rows generated), below the loop's."""
        name = f"  {self.harness.unit[:-1]} {self.index + 1}"
        return self.harness.phase(name, total, unit="rows", log=False)

    def finish(self, record: JSONDict, save: Callable[[], None], stop: str | None = None) -> None:
        """Log ``record``, checkpoint when due (always before stopping), advance the bar.
        ``stop``: the recipe's own reason to end the loop after this step (every rank passes
        the same); a signal or the budget still comes first.

        Metrics first: a kill between the two writes redoes the step on resume, which drops and
        rewrites its record; the other order could lose the record.
        """
        h = self.harness
        done = self.index + 1
        seconds = time.perf_counter() - self.started
        (h.check_step_seconds if checked_pass(record) else h.step_seconds).append(seconds)
        self.stop_reason = self._stop_reason(done)  # every rank takes part, whatever stop says
        if self.signum is None and stop is not None:
            self.stop_reason = stop
        last = done >= h.cfg.run.generations
        with stop_on_storage_error(h.run_dir, h._saved, h.unit):
            h.log(record)
            if h.is_root and (done % h.checkpoint_every == 0 or last or self.stop_reason):
                save()
                h._saved = done
        fields = self.show(record)
        self.bar.advance(1, **fields)  # off a terminal, this step's line with these fields
        if checked_pass(record) and h.reporter.live:  # kept: the live bar is transient
            text = " ".join(f"{k} {format_value(v)}" for k, v in fields.items())
            h.say(f"{h.unit[:-1]} {done}: {text}")

    def _stop_reason(self, done: int) -> str | None:
        h = self.harness
        # Every rank exchanges its signal flag here, before anything rank-local can return.
        self.signum = h.interrupt.agree(h.comm)
        if self.signum is not None:
            return (
                f"interrupted by signal {self.signum}: checkpoint at {h.unit[:-1]} "
                f"{done} saved; continue with: essa train --resume {h.run_dir}"
            )
        budget = h.cfg.run.max_wall_seconds
        # Stop before a step that would end past the budget (its forecast: next_step_seconds).
        forecast = next_step_seconds(h, done)
        # Ranks time themselves differently: they must agree to stop, or some would block.
        if budget and any_rank(h.comm, h.elapsed + forecast + h.end_reserve > budget):
            after = (
                f" and the passes after the {h.unit} ({h.end_reserve:.0f} s kept for them)"
                if h.end_reserve
                else ""
            )
            return (
                f"stopping: run.max_wall_seconds={budget:g} would be passed by the next "
                f"{h.unit[:-1]}{after}"
            )
        return None


def checked_pass(record: JSONDict) -> bool:
    """True for a step whose record holds a held-out or validation pass's score."""
    return "heldout_accuracy" in record or "val_accuracy" in record


def next_step_seconds(h: Harness, done: int) -> float:
    """The next step's forecast seconds: the median of this process's last five steps, or, when
    the next one ends in a pass (``h.check_every``), of the last steps that did. A pass makes
    its step longer (a GRPO step of 25 s and its 500-item held-out pass of 27 s), and a median
    over all steps ignores it: the step would run past the budget by the pass."""
    plain, checked = h.step_seconds[-5:], h.check_step_seconds[-5:]
    if checked and h.due(done, h.check_every):
        return float(np.median(checked))
    return float(np.median(plain or checked)) if plain or checked else 0.0
