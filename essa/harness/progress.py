"""Progress phases: a live bar per phase on a terminal, plain lines elsewhere, phases.jsonl.

A phase (model load, SFT, a held-out pass, each generation or step, the export) draws one rich
progress line while it runs on a terminal and prints plain progress lines at least every 30 s
elsewhere (a pipe or a file: Slurm, nohup, CI), the same format for every recipe; it writes one
``"event": "phase"`` record to ``phases.jsonl`` when it ends (start time, seconds, items done,
the process's peak RSS so far) besides its ``"event": "progress"`` records.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from essa.errors import UserError
from essa.rundir import MetricsLog, StorageError

JSONDict = dict[str, Any]


def format_value(value: object) -> str:
    """A shown field's value: floats to 4 significant digits, None as n/a."""
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
            text = " ".join(f"{k} {format_value(v)}" for k, v in self.fields.items())
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
        parts += [f"{k} {format_value(v)}" for k, v in dict(self.fields).items()]
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
            extra = "".join(f", {k} {format_value(v)}" for k, v in phase.fields.items())
            self.say(f"{phase.name}:{count} in {seconds:.1f} s{extra}")
