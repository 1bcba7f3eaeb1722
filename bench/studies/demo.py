"""The embedded demo over several seeds: the before/after table and the accuracy curve.

    python -m bench.studies.demo [--seeds 0 1 2] [--set key=value ...]

Runs `essa train` (the embedded default config, plus any --set overrides) once per seed in a
fresh process, then writes bench/results/demo.json, bench/results/demo.png (held-out accuracy
per generation) and prints a Markdown table (README and docs/results.md). Held-out numbers use the fixed test
split, which no choice in training ever looks at.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import Any

from bench.common import RESULTS, Row, compact_png, row, write_result
from bench.studies.common import train_demo


def mean_spread(values: list[float]) -> str:
    mean = statistics.mean(values)
    return f"{mean:.3f} ± {statistics.pstdev(values):.3f}" if len(values) > 1 else f"{mean:.3f}"


def table(runs: list[dict[str, Any]]) -> str:
    n = runs[0]["summary"]["test_size"]
    base = [r["summary"]["baseline_accuracy"] for r in runs]
    final = [r["summary"]["final_accuracy"] for r in runs]
    scale = [r["summary"]["scale_baseline"]["heldout_accuracy"] for r in runs]
    gains = [f - b for f, b in zip(final, base, strict=True)]
    # Standard error of the mean gain: per-seed binomial SE of a difference of two accuracies on
    # the same n items (an upper bound that ignores their positive correlation), over seeds.
    se = math.sqrt(
        sum((f * (1 - f) + b * (1 - b)) / n for f, b in zip(final, base, strict=True))
    ) / len(runs)
    walls = [r["command_wall_seconds"] for r in runs]
    lines = [
        f"| adapter (held-out accuracy, {n} pairs, {len(runs)} seeds: mean ± std) | accuracy |",
        "|---|---|",
        f"| SFT adapter (the starting point) | {mean_spread(base)} |",
        f"| no search: SFT adapter × best uniform factor (chosen on training prompts) | {mean_spread(scale)} |",
        f"| ESSA (CMA-ES over singular values, distribution mean) | {mean_spread(final)} |",
        "",
        f"Gain of ESSA over SFT: {statistics.mean(gains):+.3f} (per seed: "
        + ", ".join(f"{g:+.3f}" for g in gains)
        + f"); ≈ {statistics.mean(gains) / se:.1f} standard errors. "
        f"Gain over the no-search baseline: {statistics.mean(final) - statistics.mean(scale):+.3f}. "
        f"Wall time per `essa train` (2 threads, everything included): {mean_spread(walls)} s.",
    ]
    return "\n".join(lines)


def record_table(record: dict[str, Any]) -> str:
    """The table of a ``bench/results/demo.json`` record (docs/results.md renders it)."""
    return table(record["runs"])


def report_rows(result: dict[str, Any]) -> list[Row]:
    """Accuracy before/after (mean over seeds), the gain, and the cost of a run."""
    runs = result["runs"]
    n = runs[0]["summary"]["test_size"]
    base = [r["summary"]["baseline_accuracy"] for r in runs]
    final = [r["summary"]["final_accuracy"] for r in runs]
    scale = [r["summary"]["scale_baseline"]["heldout_accuracy"] for r in runs]
    gain = statistics.mean(final) - statistics.mean(base)
    seeds = f"{len(runs)} seed{'s' if len(runs) > 1 else ''}, {n} held-out pairs"
    rows = [
        row(
            "demo held-out accuracy: SFT adapter -> ESSA",
            f"{mean_spread(base)} -> {mean_spread(final)} ({gain:+.3f})",
            "ESSA > SFT",
            gain > 0,
            seeds,
        ),
        row(
            "demo: ESSA vs no-search baseline (SFT x best uniform factor)",
            f"{statistics.mean(final) - statistics.mean(scale):+.3f}",
            None,
            None,
            f"baseline {mean_spread(scale)}",
        ),
        row(
            "demo: wall seconds per `essa train` (everything included)",
            mean_spread([r["command_wall_seconds"] for r in runs]),
            None,
            None,
            f"{runs[0]['summary']['generations']} generations",
        ),
    ]
    gens = [r["generation_seconds"]["median"] for r in runs if r.get("generation_seconds")]
    if gens:
        rows.append(row("demo: median seconds per generation", mean_spread(gens), note=seeds))
    return rows


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    for run in runs:
        xs, ys = zip(*run["curve"], strict=True)
        ax.plot(xs, ys, marker="o", ms=3, label=f"ESSA seed {run['seed']}")
        scale = run["summary"]["scale_baseline"]["heldout_accuracy"]
        ax.axhline(scale, ls=":", lw=1, color=ax.lines[-1].get_color())
    ax.set_xlabel("generation (0 = SFT adapter)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("Demo: held-out accuracy (dotted: no-search baseline)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    compact_png(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--runs", type=Path, default=Path("runs/bench-demo"))
    args = parser.parse_args()
    runs = [train_demo(seed, args.overrides, args.runs) for seed in args.seeds]
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = (
        "python -m bench.studies.demo --seeds "
        + " ".join(map(str, args.seeds))
        + "".join(f" --set {o}" for o in args.overrides)
    )
    write_result("demo", {"seeds": args.seeds, "runs": runs}, command)
    plot(runs, RESULTS / "demo.png")
    print(table(runs))
    print(f"\n(reproduce: {command})")


if __name__ == "__main__":
    main()
