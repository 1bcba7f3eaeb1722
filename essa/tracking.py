"""Experiment trackers named in ``run.report_to``: TensorBoard, Weights & Biases, Trackio.

Each library is imported only when named (the ``[track]`` extra installs all three), and none
needs the network:

- ``tensorboard``: event files in ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR``);
- ``wandb``: an offline run in ``RUN_DIR/wandb`` (``wandb sync RUN_DIR/wandb/offline-run-*``
  uploads it later); ``WANDB_MODE=online`` in the environment logs live instead;
- ``trackio``: its local SQLite store in ``RUN_DIR/trackio`` unless ``TRACKIO_DIR`` is set
  (``TRACKIO_DIR=RUN_DIR/trackio trackio show``).

What is logged: the numeric fields of every metrics record (strings such as ``event`` are not
metrics), the samples table, the resolved config and the summary. ``step`` is the number of
generations completed, so the baseline (``generation: -1``) sits at step 0.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from essa.errors import UserError

TRACKERS = ("tensorboard", "wandb", "trackio")
SAMPLE_COLUMNS = ("generation", "prompt", "completion", "extracted", "reference", "reward")
_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


class Tracker(Protocol):
    def log(self, record: Mapping[str, Any], step: int) -> None: ...
    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int) -> None: ...
    def log_summary(self, summary: Mapping[str, Any]) -> None: ...
    def close(self) -> None: ...


def scalars(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric leaves of ``record``, nested keys joined by ``/`` (bools and text dropped).

    >>> scalars({"generation": 3, "event": "x", "scale": {"factor": 2.0}, "ok": True})
    {'generation': 3.0, 'scale/factor': 2.0}
    """
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def samples_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """The samples as a Markdown table (TensorBoard's text plugin renders it)."""

    def cell(value: Any) -> str:
        text = "" if value is None else str(value)
        return text.replace("|", "\\|").replace("\n", "\\n")

    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in SAMPLE_COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


class TensorBoardTracker:
    def __init__(self, run_dir: Path, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)
        self.last_step = 0

    def log(self, record: Mapping[str, Any], step: int) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, step)
        self.last_step = max(self.last_step, step)

    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        self.writer.add_text("samples", samples_markdown(rows), step)

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        for key, value in scalars(summary, "summary/").items():
            self.writer.add_scalar(key, value, self.last_step)
        text = "```\n" + json.dumps(summary, indent=2, default=str) + "\n```"
        self.writer.add_text("summary", text, self.last_step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path, config: Mapping[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "essa-align",
            name=run_dir.name,
            dir=str(run_dir),
            mode=os.environ.get("WANDB_MODE") or "offline",  # type: ignore[arg-type]
            config=dict(config),
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, record: Mapping[str, Any], step: int) -> None:
        self.run.log(scalars(record), step=step)

    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        data = [[row.get(c) for c in SAMPLE_COLUMNS] for row in rows]
        self.run.log(
            {"samples": self.wandb.Table(columns=list(SAMPLE_COLUMNS), data=data)}, step=step
        )

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        self.run.summary.update(_plain(summary))

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    def __init__(self, run_dir: Path, config: Mapping[str, Any]) -> None:
        # trackio reads TRACKIO_DIR once, when first imported.
        os.environ.setdefault("TRACKIO_DIR", str((run_dir / "trackio").resolve()))
        with contextlib.redirect_stdout(io.StringIO()):  # its banner would split our console
            import trackio

            self.trackio = trackio
            self.run = trackio.init(
                project="essa-align",
                name=run_dir.name,
                config=dict(config),
                auto_log_cpu=False,
                auto_log_gpu=False,
            )
        self.last_step = 0

    def log(self, record: Mapping[str, Any], step: int) -> None:
        self.run.log(scalars(record), step=step)
        self.last_step = max(self.last_step, step)

    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        data = [[row.get(c) for c in SAMPLE_COLUMNS] for row in rows]
        table = self.trackio.Table(columns=list(SAMPLE_COLUMNS), data=data)
        self.run.log({"samples": table}, step=step)

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        # trackio has no summary object: the numbers go in as one last record.
        self.run.log(scalars(summary, "summary/"), step=self.last_step)

    def close(self) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            self.trackio.finish()  # also clears trackio's current run, so atexit has nothing left


_FACTORIES: dict[str, Callable[[Path, Mapping[str, Any]], Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "trackio": TrackioTracker,
}


class Trackers:
    """Every configured tracker behind one object; with none configured each call is a no-op."""

    def __init__(self, trackers: Sequence[Tracker] = ()) -> None:
        self.trackers = list(trackers)

    def log(self, record: Mapping[str, Any], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(record, step)

    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        if rows:
            for tracker in self.trackers:
                tracker.log_samples(rows, step)

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log_summary(summary)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_trackers(names: Sequence[str]) -> None:
    """Refuse, in one line, a tracker that is unknown or not installed (before any model loads)."""
    import importlib.util

    for name in names:
        if name not in _MODULES:
            raise UserError(
                f"run.report_to: unknown tracker {name!r}; known: {', '.join(TRACKERS)}"
            )
        if importlib.util.find_spec(_MODULES[name]) is None:
            raise UserError(
                f"run.report_to: {name} is not installed: pip install 'essa-align[track]' "
                f"(or pip install {name})"
            )


def make_trackers(names: Sequence[str], run_dir: Path, config: Mapping[str, Any]) -> Trackers:
    """The trackers of ``run.report_to`` for ``run_dir``, with ``config`` (plain data) logged."""
    check_trackers(names)
    return Trackers([_FACTORIES[name](Path(run_dir), config) for name in names])


def _plain(value: Any) -> Any:
    """JSON-safe copy (NaN and inf as None) for trackers that keep a summary object."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
