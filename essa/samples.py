"""Samples to read: a few held-out prompts with the completion, extracted answer, reference and
score, written to ``RUN_DIR/samples.jsonl`` and shown compactly on the console.

The same held-out prompts (the first :data:`SAMPLES_PER_EVAL` of the fixed test split) are
shown at every evaluation, so one can follow a prompt through the run. ``essa eval --output``
writes the same record per item (:func:`item_records`). Pure Python except for rich, imported
when printing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from essa.rundir import MetricsLog

SAMPLES_PER_EVAL = 4
SAMPLES_NAME = "samples.jsonl"
_CELL = 48  # characters of prompt / completion shown on the console


def _extract(completion: str) -> str | None:
    from essa.rewards import extract_answer

    return extract_answer(completion)


def item_records(
    questions: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str | None],
    scores: Sequence[float | None],
    extract: Callable[[str], str | None] = _extract,
) -> list[dict[str, Any]]:
    """One record per item: prompt (the question, before the template), completion, extracted
    answer, reference and score (None: ungradable).

    >>> item_records(["1+2="], ["3"], ["3"], [1.0])
    [{'prompt': '1+2=', 'completion': '3', 'extracted': '3', 'reference': '3', 'reward': 1.0}]
    """
    rows = zip(questions, completions, answers, scores, strict=True)
    return [
        {
            "prompt": question,
            "completion": completion,
            "extracted": extract(completion),
            "reference": answer,
            "reward": score,
        }
        for question, completion, answer, score in rows
    ]


def sample_rows(
    generation: int,
    questions: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str | None],
    scores: Sequence[float | None],
    k: int = SAMPLES_PER_EVAL,
) -> list[dict[str, Any]]:
    """The first ``k`` held-out items of an evaluation after ``generation`` as sample records
    (``generation`` first; -1 is the SFT baseline)."""
    n = min(k, len(completions))
    items = item_records(questions[:n], completions[:n], answers[:n], scores[:n])
    return [{"generation": generation, **item} for item in items]


def samples_log(run_dir: Path, *, enabled: bool = True) -> MetricsLog:
    """``RUN_DIR/samples.jsonl``, appended like metrics.jsonl (and truncated the same way on
    resume: ``truncate_after(generation)``)."""
    return MetricsLog(Path(run_dir) / SAMPLES_NAME, enabled=enabled)


def write_samples(log: MetricsLog, rows: Sequence[dict[str, Any]]) -> None:
    for row in rows:
        log.write(row)


def _short(text: Any, width: int = _CELL) -> str:
    flat = "" if text is None else str(text).replace("\n", "⏎ ")
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def samples_table(rows: Sequence[dict[str, Any]], title: str | None = None) -> Any:
    """A compact rich Table of sample rows: one line each, long text cut with an ellipsis.

    ``title`` defaults to one naming the rows' ``generation`` field (-1: the SFT start).
    """
    from rich.table import Table

    generation = rows[0]["generation"] if rows else None
    if title is None:
        title = (
            "samples (SFT start)" if generation == -1 else f"samples after generation {generation}"
        )
    table = Table(title=title, title_justify="left", box=None, pad_edge=False, show_edge=False)
    for name in ("prompt", "completion", "answer", "reference", "reward"):
        table.add_column(name, no_wrap=True, overflow="ellipsis")
    for row in rows:
        reward = row["reward"]
        table.add_row(
            _short(row["prompt"]),
            _short(row["completion"]),
            _short(row["extracted"], 16),
            _short(row["reference"], 16),
            "n/a" if reward is None else f"{reward:.2f}",
        )
    return table


def print_samples(console: Any, rows: Sequence[dict[str, Any]], title: str | None = None) -> None:
    """Show ``rows`` on a rich console (nothing without a console or rows)."""
    if console is not None and rows:
        console.print(samples_table(rows, title))
