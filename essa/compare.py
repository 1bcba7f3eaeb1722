"""Compare finished runs (any mix of ESSA and GRPO): a Markdown table and one PNG.

    essa compare RUN_DIR [RUN_DIR ...] [--target 0.9] [--output DIR]

Reads each run's summary.json and metrics.jsonl. Curves use cumulative *training* seconds (the
per-generation/step ``seconds``: sampling, scoring and the update; not SFT and not held-out
evaluation) and cumulative generated tokens (``new_tokens``), so both algorithms are measured
the same way. Held-out accuracy points are the ``evaluation.every`` measurements plus the final
one; "reward" is ESSA's ``mean_fitness`` or GRPO's ``mean_reward`` on training prompts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from essa.errors import UserError


@dataclass
class RunCurves:
    name: str
    label: str  # e.g. "essa (cma_es)" or "grpo (dapo, lora)"
    summary: dict[str, Any]
    accuracy: list[tuple[float, float, float]] = field(default_factory=list)  # (s, tokens, acc)
    reward: list[tuple[float, float, float]] = field(default_factory=list)  # (s, tokens, reward)


def load_run(run_dir: Path) -> RunCurves:
    """Curves of one finished run directory."""
    summary_path, metrics_path = run_dir / "summary.json", run_dir / "metrics.jsonl"
    if not summary_path.exists() or not metrics_path.exists():
        raise UserError(f"{run_dir}: not a finished run (needs summary.json and metrics.jsonl)")
    summary = json.loads(summary_path.read_text())
    algorithm = summary.get("algorithm", "essa")
    # Runs written by other trainers (bench/studies/trl_grpo.py) name themselves.
    if "label" in summary:
        label = str(summary["label"])
    elif algorithm in ("grpo", "dpo"):
        label = f"{algorithm} ({summary.get('loss')}, {summary.get('trainable')})"
    elif algorithm == "scalebio":
        label = "scalebio"
    else:
        label = "essa"
    curves = RunCurves(run_dir.name, label, summary)
    seconds = tokens = 0.0
    for line in metrics_path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line
        if record.get("generation", -1) >= 0:
            seconds += record.get("seconds") or 0.0
            tokens += record.get("new_tokens") or 0
            reward = record.get("mean_reward", record.get("mean_fitness"))
            if reward is not None:
                curves.reward.append((seconds, tokens, float(reward)))
        if record.get("heldout_accuracy") is not None:
            curves.accuracy.append((seconds, tokens, float(record["heldout_accuracy"])))
    final = summary.get("final_accuracy")
    if final is not None and (not curves.accuracy or curves.accuracy[-1][:2] != (seconds, tokens)):
        curves.accuracy.append((seconds, tokens, float(final)))
    return curves


def _first_reaching(points: list[tuple[float, float, float]], target: float) -> tuple | None:
    return next(((s, t) for s, t, acc in points if acc >= target), None)


def _fmt(value: float | None, spec: str) -> str:
    return (
        "n/a"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else (format(value, spec))
    )


def table(runs: list[RunCurves], target: float) -> str:
    """Markdown: accuracy before/final/best, time and tokens to the target, memory, tokens."""
    lines = [
        f"| run | algorithm | SFT start | final | best | train s to {target:g} "
        f"| tokens to {target:g} | train s | tokens | wall s | peak RSS MB | peak CUDA MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        s = run.summary
        best = max((acc for _, _, acc in run.accuracy), default=None)
        reached = _first_reaching(run.accuracy, target)
        seconds, tokens = (run.accuracy[-1][0], run.accuracy[-1][1]) if run.accuracy else (0, 0)
        lines.append(
            "| "
            + " | ".join(
                [
                    run.name,
                    run.label,
                    _fmt(s.get("baseline_accuracy"), ".3f"),
                    _fmt(s.get("final_accuracy"), ".3f"),
                    _fmt(best, ".3f"),
                    _fmt(reached[0] if reached else None, ".1f"),
                    _fmt(reached[1] if reached else None, ",.0f"),
                    _fmt(seconds, ".1f"),
                    _fmt(tokens, ",.0f"),
                    _fmt(s.get("wall_seconds"), ".1f"),
                    _fmt(s.get("peak_rss_mb"), ".0f"),
                    _fmt(s.get("peak_cuda_allocated_mb"), ".0f"),
                ]
            )
            + " |"
        )
    lines += [
        "",
        "Training seconds and tokens exclude SFT and held-out evaluation; wall s includes them. "
        "Training reward is of greedy completions for ESSA and of completions sampled at "
        "grpo.temperature for GRPO, so only held-out accuracy compares across algorithms.",
    ]
    return "\n".join(lines)


def plot(runs: list[RunCurves], path: Path) -> None:
    """2 x 2 PNG: held-out accuracy and training reward vs training seconds and vs tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), dpi=110)
    for run in runs:
        for row, points in enumerate((run.accuracy, run.reward)):
            if not points:
                continue
            seconds, tokens, raw = zip(*points, strict=True)
            # Per-step rewards are noisy mini-batch means: show a running mean.
            values = _running_mean(raw, max(1, len(raw) // 25)) if row == 1 else list(raw)
            label = f"{run.name}: {run.label}"
            style = {"marker": "o" if row == 0 else None, "ms": 3, "label": label}
            axes[row][0].plot(seconds, values, **style)
            axes[row][1].plot(tokens, values, **style)
    for col, xlabel in enumerate(("training seconds", "generated tokens")):
        axes[1][col].set_xlabel(xlabel)
        axes[0][col].set_ylabel("held-out accuracy")
        axes[1][col].set_ylabel("mean training reward (running mean)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _running_mean(values: tuple[float, ...], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def compare(run_dirs: list[Path], output: Path, target: float) -> str:
    """Write ``output/compare.md`` and ``output/compare.png``; return the Markdown."""
    runs = [load_run(d) for d in run_dirs]
    output.mkdir(parents=True, exist_ok=True)
    text = table(runs, target)
    (output / "compare.md").write_text(text + "\n")
    plot(runs, output / "compare.png")
    return text
