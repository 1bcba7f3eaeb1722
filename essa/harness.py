"""The run harness every recipe runs in: what a run does around its algorithm.

A recipe supplies its state, its step and its checkpoint contents; the harness owns the rest:

* the resolved config, written atomically at the start of a fresh run (``config.yaml``);
* the metrics log (``metrics.jsonl``, rank 0 only) and its truncation on resume;
* the step loop: SIGINT/SIGTERM finish the current step, checkpoint it and exit 130/143; the
  wall-clock budget ``run.max_wall_seconds`` stops the loop before a step that is forecast to
  end past it (the median of the last five steps), agreed across ranks before anyone stops;
* the checkpoint cadence (every ``checkpoint_every`` steps, and always before stopping) with a
  storage fault turned into one line that says what was kept;
* progress phases (model load, SFT, held-out passes, each generation or step, export): one rich
  progress line per phase on a terminal, plain progress lines at least every 30 s elsewhere (a
  pipe or a file: Slurm, nohup, CI), the same format for every recipe, and one record per phase
  in ``phases.jsonl`` (``"event": "phase"``, start time, seconds, items done, the process's peak
  RSS so far) besides its ``"event": "progress"`` records;
* the held-out metric (``evaluation.metric``, :meth:`Harness.score`) and, at the baseline,
  every ``evaluation.every`` steps and the final evaluation, a few samples to read
  (``samples.jsonl``, truncated on resume like the metrics, and a compact console table);
* the trackers of ``run.report_to``: every metrics record (:meth:`Harness.log`), the samples,
  the resolved config and the summary; ``with harness:`` closes them whatever happens;
* the summary: ``summary.json`` (atomic, naming ``heldout_metric``) and the closing line.

``phases.jsonl`` is a file of its own rather than more lines in ``metrics.jsonl``: readers of
metrics.jsonl (essa compare, bench/, tests) take every line as a generation or baseline record.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

from essa.config import Config, dump_config, to_dict
from essa.dist import Comm, any_rank
from essa.errors import UserError
from essa.evaluation import check_heldout_answers, heldout_metric, score_heldout
from essa.rundir import (
    MetricsLog,
    StorageError,
    atomic_write_json,
    atomic_write_text,
    recover,
    stop_on_storage_error,
)
from essa.samples import print_samples, sample_rows, samples_log, write_samples
from essa.tracking import Trackers, make_trackers
from essa.types import Example

JSONDict = dict[str, Any]


class Interrupt:
    """SIGINT/SIGTERM set ``signum``; the loop finishes its step, checkpoints and exits.

    A second signal acts at once (KeyboardInterrupt / default termination); the last
    checkpoint on disk is then still complete, because every write is atomic.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.signum = signum

    def __enter__(self) -> Interrupt:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def agree(self, comm: Comm) -> int | None:
        """The signal every rank stops for: the first rank's (in rank order) that caught one.

        A collective, called by every rank at the same point of every step: a signal that
        reached one rank only (``kill`` of one process, a scheduler signalling one task) stops
        them all after the same step, where a rank deciding alone would leave the others
        blocked in the next step's exchange.
        """
        if comm.world_size == 1:
            return self.signum
        caught = [int(s) for s in comm.allgather_str(str(self.signum or 0)) if s != "0"]
        return caught[0] if caught else None


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "n/a" if value is None else str(value)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# Where stdout is not a terminal (Slurm, nohup, CI) the live bars draw nothing, so every open
# phase prints a plain progress line at least this often; ESSA_PROGRESS_SECONDS overrides it
# (0: a line at every event of a phase, which is what the tests use).
PROGRESS_SECONDS = 30.0
PROGRESS_ENV = "ESSA_PROGRESS_SECONDS"
# A phase's first plain line comes this soon (at most the interval): a log then shows the model
# load, the tokenising or SFT's slow first step under way within seconds, and no stretch
# between two phases' lines (the gap, then the next phase's first line) reaches the interval.
FIRST_LINE_SECONDS = 10.0
BEAT_FLOOR_SECONDS = 0.5  # the heartbeat thread never wakes more often than this


def progress_interval(environ: Mapping[str, str] | None = None) -> float:
    """Seconds between a phase's plain progress lines: $ESSA_PROGRESS_SECONDS, else 30."""
    raw = (os.environ if environ is None else environ).get(PROGRESS_ENV, "").strip()
    if not raw:
        return PROGRESS_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise UserError(f"{PROGRESS_ENV}={raw}: expected a number of seconds, 0 or more")
    return value


class Phase:
    """One stage of a run: a progress line while it runs, a record and a line when it ends."""

    def __init__(
        self,
        reporter: Reporter,
        name: str,
        total: int | None,
        unit: str,
        start: int,
        log: bool,
        every: bool = False,
    ) -> None:
        self.reporter = reporter
        self.name = name
        self.total = total
        self.unit = unit
        self.done = start
        self.log = log  # False: a transient bar only (no record, no closing line)
        self.every = every  # a plain line at every advance (the loop: one per step)
        self.fields: JSONDict = {}
        self._task: Any = None
        self._first = start  # items done before this process: the ETA counts from here
        self._started = time.time()
        self._clock = time.perf_counter()
        self.last_line = self._clock  # when the last plain line or progress record went out

    def advance(self, n: int = 1, **fields: object) -> None:
        """``n`` more items done; ``fields`` (loss, lr, ...) replace the shown values."""
        self.done += n
        self._show(fields)
        self.reporter._tick(self, force=self.every)

    def update(self, **fields: object) -> None:
        self._show(fields)
        self.reporter._tick(self)

    def _show(self, fields: JSONDict) -> None:
        self.fields.update(fields)
        if self._task is not None:
            text = " ".join(f"{k} {_fmt(v)}" for k, v in self.fields.items())
            self.reporter.bar.update(self._task, completed=self.done, description=text)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self._clock

    @property
    def eta(self) -> float | None:
        """Seconds left at this process's rate so far; None before the first item."""
        done = self.done - self._first
        if not self.total or done <= 0:
            return None
        return max(0, self.total - self.done) * self.seconds / done

    def line(self) -> str:
        """The plain progress line: ``SFT: 20/200 steps, 31.0 s so far, eta 4 min, loss 0.5``."""
        parts = [f"{self.done}/{self.total} {self.unit}".rstrip()] if self.total else []
        parts.append(f"{self.seconds:.1f} s so far")
        eta = self.eta
        if eta is not None:
            parts.append(f"eta {_duration(eta)}")
        parts += [f"{k} {_fmt(v)}" for k, v in dict(self.fields).items()]
        return f"{self.name}: " + ", ".join(parts)

    def record(self, event: str, seconds: float, **extra: object) -> JSONDict:
        """This phase as a phases.jsonl record (``phase`` when it ends, ``progress`` before)."""
        return {
            "event": event,
            "phase": self.name,
            "started": round(self._started, 3),
            "seconds": round(seconds, 3),
            "done": self.done,
            "total": self.total,
            "unit": self.unit,
            **extra,
            **dict(self.fields),
        }

    def __enter__(self) -> Phase:
        self._task = self.reporter._open(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        self.reporter._close(self, failed=exc_type is not None)


class Reporter:
    """The console side of a run: messages and progress phases (rank 0; silent elsewhere).

    ``console`` is a rich Console or None (no output). With ``show_progress`` off, phases draw
    nothing but still write their records to ``log``.

    On a terminal each phase is a live bar. Elsewhere (a pipe or a file: Slurm, nohup, CI) the
    bars would draw nothing until a phase ends, so each open phase prints a plain progress line
    (:meth:`Phase.line`) whenever ``interval`` seconds passed since its last one: checked when
    the phase starts and advances, and by a heartbeat thread for phases that go quiet (a model
    loading, one long generation). The loop's phase (``every``) prints one line per step. In
    either view, each due line also goes to ``log`` as a ``progress`` record.
    """

    def __init__(
        self,
        console: Any,
        *,
        show_progress: bool = True,
        log: MetricsLog | None = None,
        interval: float | None = None,
        first: float = FIRST_LINE_SECONDS,
    ) -> None:
        self.console = console
        self.show = show_progress and console is not None
        # Live bars only where they redraw in place; a pipe or file gets the plain lines.
        self.live = self.show and (console.is_terminal or console.is_jupyter)
        self.plain = self.show and not self.live
        self.log = log
        self.interval = progress_interval() if interval is None else interval
        self.first = min(first, self.interval)  # seconds to a phase's first plain line
        self.bar: Any = None  # one rich Progress for all open phases (rich allows one live view)
        self._open_phases = 0
        # A budgeted run's plan (essa.es.plan): phase name -> planned seconds, and the seconds
        # the phases of that name actually took, for phases.jsonl and the summary.
        self.planned: dict[str, float] = {}
        self.actual: dict[str, float] = {}
        self._phases: list[Phase] = []  # open, outermost first: what the heartbeat reports
        self._lock = threading.Lock()  # one line or record at a time, from either thread
        self._beat: tuple[threading.Thread, threading.Event] | None = None

    @property
    def _logging(self) -> bool:
        return self.log is not None and self.log.enabled

    def say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text, soft_wrap=True)  # no hard wraps: paths stay copyable

    def phase(
        self,
        name: str,
        total: int | None = None,
        *,
        unit: str = "",
        start: int = 0,
        log: bool = True,
        every: bool = False,
    ) -> Phase:
        """``with reporter.phase("sft", total=steps, unit="steps") as p: p.advance(1, loss=x)``."""
        return Phase(self, name, total, unit, start, log, every)

    def _open(self, phase: Phase) -> Any:
        with self._lock:
            phase.last_line -= self.interval - self.first  # its first line is due sooner
            self._phases.append(phase)
        self._start_beat()
        self._tick(phase)  # due at once only with interval 0
        if not self.live:
            return None
        if self.bar is None:
            self.bar = self._progress()
            self.bar.start()
        self._open_phases += 1
        return self.bar.add_task("", name=phase.name, total=phase.total, completed=phase.done)

    def _progress(self) -> Any:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        return Progress(
            TextColumn("[bold]{task.fields[name]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
            console=self.console,
            transient=True,  # finished phases leave their closing line, not a stale bar
        )

    # ------------------------------------------------------------------ plain lines
    def _tick(self, phase: Phase, *, force: bool = False) -> None:
        """A plain line and a progress record for ``phase`` when one is due; with ``force``
        a plain line in any case (a step's summary; the record waits until one is due)."""
        if not (self.plain or (self._logging and phase.log)):
            return
        with self._lock:
            if phase not in self._phases:
                return  # closed meanwhile (the heartbeat thread): its closing line is out
            due = time.perf_counter() - phase.last_line >= self.interval
            if due or force:
                self._line(phase, record=due)

    def _line(self, phase: Phase, *, record: bool) -> None:
        phase.last_line = time.perf_counter()
        if self.plain:
            self.say(phase.line())
        if record and phase.log and self.log is not None:
            eta = phase.eta
            extra = {} if eta is None else {"eta_seconds": round(eta, 1)}
            self.log.write(phase.record("progress", phase.seconds, **extra))

    def _start_beat(self) -> None:
        if self._beat is not None or not (self.plain or self._logging):
            return
        stop = threading.Event()
        thread = threading.Thread(target=self._heartbeat, args=(stop,), daemon=True)
        self._beat = (thread, stop)
        thread.start()

    def _stop_beat(self) -> None:
        if self._beat is not None:
            thread, stop = self._beat
            self._beat = None
            stop.set()
            thread.join()

    def _heartbeat(self, stop: threading.Event) -> None:
        """Lines for open phases that went ``interval`` seconds without one."""
        while not stop.wait(self._next_beat()):
            for phase in list(self._phases):
                try:
                    self._tick(phase)
                except StorageError:
                    return  # the run's own next write stops it with what was kept

    def _next_beat(self) -> float:
        with self._lock:
            due = [p.last_line + self.interval for p in self._phases]
        wait = min(due) - time.perf_counter() if due else self.interval
        return max(wait, BEAT_FLOOR_SECONDS)

    def _close(self, phase: Phase, *, failed: bool) -> None:
        seconds = phase.seconds
        with self._lock:
            self._phases.remove(phase)
            last = not self._phases
        if last:
            self._stop_beat()
        if phase._task is not None:
            self._open_phases -= 1
            if self._open_phases == 0:  # stopped with its last bar, so no empty line is left
                self.bar.stop()
                self.bar = None
            else:
                self.bar.remove_task(phase._task)
        if not phase.log or failed:
            return
        self.actual[phase.name] = self.actual.get(phase.name, 0.0) + seconds
        planned = (
            {"planned_seconds": self.planned[phase.name]} if phase.name in self.planned else {}
        )
        if self.log is not None:
            from essa.backends.memory import peak_rss_mb  # torch is loaded by the first phase

            # The process peak so far: the first phase whose record reaches the run's
            # peak_rss_mb is the one that set it (SFT's backward or the search's forward).
            self.log.write(phase.record("phase", seconds, peak_rss_mb=peak_rss_mb(), **planned))
        if self.show:
            count = f" {phase.done}/{phase.total} {phase.unit}" if phase.total else ""
            extra = "".join(f", {k} {_fmt(v)}" for k, v in phase.fields.items())
            self.say(f"{phase.name}:{count} in {seconds:.1f} s{extra}")


HELDOUT_SCORES_NAME = "heldout_scores.jsonl"
HELDOUT_RECORD_KEYS = ("generation", "final", "metric", "pass", "scores")


def heldout_record(
    generation: int, final: bool, metric: str, name: str, scores: Sequence[float]
) -> JSONDict:
    """One record of heldout_scores.jsonl (keys :data:`HELDOUT_RECORD_KEYS`)."""
    values = (generation, final, metric, name, [float(s) for s in scores])
    return dict(zip(HELDOUT_RECORD_KEYS, values, strict=True))


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
        mine = (
            [] if not texts else score_heldout(self.metric, texts, examples[part], prompts[part])[1]
        )
        scores = self.comm.allgather_fitness(np.asarray(mine, dtype=np.float64)).tolist()
        if generation is not None and self.is_root and texts:
            self._samples(generation, final, texts, examples[part], mine)
        if generation is not None or name is not None:
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
        """The summary fields every recipe reports; ``extra`` adds the recipe's own."""
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
        h.step_seconds.append(time.perf_counter() - self.started)
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
        checked = "heldout_accuracy" in record or "val_accuracy" in record
        if checked and h.reporter.live:  # kept: the live bar is transient
            text = " ".join(f"{k} {_fmt(v)}" for k, v in fields.items())
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
        # Stop before a step that would end past the budget: the next one is forecast to take
        # as long as the median of the last few (a held-out pass makes one step longer).
        forecast = float(np.median(h.step_seconds[-5:])) if h.step_seconds else 0.0
        # Ranks time themselves differently: they must agree to stop, or some would block.
        if budget and any_rank(h.comm, h.elapsed + forecast > budget):
            return (
                f"stopping: run.max_wall_seconds={budget} would be passed by the next {h.unit[:-1]}"
            )
        return None


def write_json_checkpoint(run_dir: Path, data: JSONDict, step: int) -> None:
    """RUN_DIR/checkpoint.json, replaced atomically (plain JSON: nothing read back is executed)."""
    from essa.rundir import before_checkpoint

    atomic_write_json(run_dir / "checkpoint.json", data, before_rename=before_checkpoint(step))


def read_json_checkpoint(run_dir: Path, restore: Callable[[JSONDict], None]) -> JSONDict | None:
    """The checkpoint's data after ``restore(data)`` took its part; None when there is none.

    A checkpoint that cannot be restored is one UserError line, never a traceback.
    """
    path = run_dir / "checkpoint.json"
    recover(path)
    if not path.exists():
        return None
    try:
        data: JSONDict = json.loads(path.read_text())
        restore(data)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
        # Atomic writes never leave a torn checkpoint; this one was edited, damaged, or was
        # written under another optimizer setting (--set on resume).
        first = str(err).splitlines()[0] if str(err) else "invalid"
        raise UserError(
            f"{path}: cannot resume from this checkpoint ({type(err).__name__}: {first}); "
            "start a new run or restore the file"
        ) from None
    return data
