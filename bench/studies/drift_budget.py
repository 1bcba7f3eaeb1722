"""The search's drift budget on and off: on-task gain against off-task drift, one plot.

    python -m bench.studies.drift_budget [--config CONFIG] [--seeds 0 1 2] [--set k=v] [--reuse]

Per seed, ``essa train`` (the embedded demo unless ``--config``) once per arm, each in a fresh
process, the same config and seed otherwise:

* **off**: no drift budget (the shipped behaviour);
* **anchor**: ``optimizer.drift_budget.anchor=1``, weight decay toward the SFT point;
* **KL penalty**: ``optimizer.drift_budget.kl_penalty=10`` on the anchor set;
* **KL budget**: ``optimizer.drift_budget.kl_budget`` at 1.25x the seed's own SFT adapter's
  off-task KL(base || SFT) (the *off* run's drift report), i.e. a quarter more drift than SFT;
* **decay**: ``optimizer.drift_budget.decay`` at 0.02, 0.05 and 0.1, the mean moved back toward
  its start after every generation (not in the default arms: ``--arms``).

Reported per arm: held-out gain over the SFT adapter (paired SE over the same items), and the
final drift report's KL(base || tuned), KL(SFT || tuned), the search's update size
||dW_search|| / ||W0|| and retention. None of the values is tuned: they are round numbers of
the scale of each term (fitness differences of a few prompts in 32, KL of the order of the SFT
adapter's own).

Writes bench/results/drift_budget.json, drift_budget.md (the table in docs/drift-control.md) and
drift_budget.png (gain against KL(base || tuned), one marker per run).

``--passes`` runs nothing: it reads the arms' runs under ``--root`` (finished or not) and writes
``OUT_passes.md``, their figures at the held-out checks every arm has reached (validation
accuracy and its gain over the SFT adapter, the pass's off-task KL and update size).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.common import RESULTS, compact_png, write_result
from bench.studies.common import paired, passes, pooled, sets, timed

ARMS: dict[str, list[str]] = {
    "off": [],
    "anchor 1": ["optimizer.drift_budget.anchor=1"],
    "KL penalty 10": ["optimizer.drift_budget.kl_penalty=10"],
    "KL budget 1.25x SFT": [],  # the value comes from the seed's off run
    "decay 0.02": ["optimizer.drift_budget.decay=0.02"],
    "decay 0.05": ["optimizer.drift_budget.decay=0.05"],
    "decay 0.1": ["optimizer.drift_budget.decay=0.1"],
}
BUDGET_ARM = "KL budget 1.25x SFT"
DEFAULT_ARMS = ["off", "anchor 1", "KL penalty 10", BUDGET_ARM]


def run_name(arm: str) -> str:
    """The arm's run directory prefix under ``--root``."""
    return arm.replace(" ", "_").replace(".", "")


def one_run(args: argparse.Namespace, arm: str, seed: int, extra: list[str]) -> dict[str, Any]:
    """One ``essa train`` of ``arm``; what the table reads of it."""
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    name = run_name(arm)
    run_dir = root / f"{name}-seed{seed}"
    config = [args.config] if args.config else []
    cli = ["train", *config, "--overwrite", "--run-dir", str(run_dir),
           *sets([f"run.seed={seed}", "run.show_progress=false", *args.overrides, *extra])]  # fmt: skip
    seconds = timed(cli, run_dir / "summary.json", root / f"{name}-seed{seed}.log",
                    args.threads, args.reuse)  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    scores = passes(run_dir)
    d = summary.get("drift", {})
    return {
        "arm": arm,
        "seed": seed,
        "sets": extra,
        "wall_seconds": seconds,
        "sft": statistics.mean(scores["sft"]),
        "final": statistics.mean(scores["final"]),
        "vs_sft": paired(scores["final"], scores["sft"]),
        "kl_base": d.get("kl_base"),
        "kl_sft": d.get("kl_sft"),
        "kl_base_sft": d.get("kl_base_sft"),
        "update_search": d.get("update", {}).get("search", {}).get("mean"),
        "retention": d.get("retention", {}).get("tuned"),
        "generations": summary["generations"],
    }


def run_seed(args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    runs = [one_run(args, "off", seed, [])]
    for arm in args.arms:
        if arm == "off":
            continue
        extra = ARMS[arm]
        if arm == BUDGET_ARM:
            budget = 1.25 * runs[0]["kl_base_sft"]
            extra = [f"optimizer.drift_budget.kl_budget={budget:.6g}"]
        runs.append(one_run(args, arm, seed, extra))
        r = runs[-1]
        print(f"[drift_budget] seed {seed} {arm}: gain {r['vs_sft']['gain']:+.3f}, "
              f"KL(base||tuned) {r['kl_base']:.4f}", flush=True)  # fmt: skip
    return runs


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per arm: the pooled gain over SFT and the mean drift figures over seeds."""
    out: dict[str, dict[str, Any]] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        row: dict[str, Any] = {"seeds": len(mine), "gain": pooled(mine, "vs_sft")}
        for key in ("sft", "final", "kl_base", "kl_sft", "kl_base_sft", "update_search",
                    "retention", "generations"):  # fmt: skip
            values = [r[key] for r in mine if r[key] is not None]
            row[key] = statistics.mean(values) if values else None
        out[arm] = row
    return out


def table(summary: dict[str, dict[str, Any]]) -> str:
    def f(x: float | None, digits: int = 4) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    lines = [
        "| arm | seeds | SFT | final | gain (SE) | KL(base‖tuned) | KL(SFT‖tuned) | "
        "‖ΔW search‖/‖W0‖ | retention |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, s in summary.items():
        g = s["gain"]
        lines.append(
            f"| {arm} | {s['seeds']} | {f(s['sft'], 3)} | {f(s['final'], 3)} | "
            f"{g['gain']:+.3f} ({g['se']:.3f}) | {f(s['kl_base'])} | {f(s['kl_sft'])} | "
            f"{f(s['update_search'])} | {f(s['retention'], 3)} |"
        )
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8), dpi=120)
    for marker, arm in zip("osD^vPX*", dict.fromkeys(r["arm"] for r in runs), strict=False):
        mine = [r for r in runs if r["arm"] == arm]
        ax.scatter([r["kl_base"] for r in mine], [r["vs_sft"]["gain"] for r in mine],
                   marker=marker, label=arm)  # fmt: skip
    sft = [r["kl_base_sft"] for r in runs if r["kl_base_sft"] is not None]
    if sft:
        ax.axvline(statistics.mean(sft), ls=":", lw=1, color="grey", label="SFT adapter's KL")
    ax.axhline(0, lw=0.8, color="black")
    ax.set_xlabel("off-task KL(base || tuned), per token")
    ax.set_ylabel("held-out gain over SFT")
    ax.set_title("Drift budget on/off: on-task gain vs off-task drift", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    compact_png(path)


PASS_FIELDS = ("val_accuracy", "val_gain", "val_se", "drift_kl_base", "drift_kl_sft",
               "drift_update")  # fmt: skip


def pass_records(run_dir: Path) -> dict[int, dict[str, float]]:
    """A run's held-out checks so far, by generation: the metrics.jsonl fields of each."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    records = (json.loads(line) for line in lines)
    return {r["generation"]: {k: r[k] for k in PASS_FIELDS} for r in records if "val_gain" in r}


def passes_table(arms: dict[str, dict[int, dict[str, float]]]) -> str:
    """Per held-out check that every arm reached, one row per arm."""
    common = sorted(set.intersection(*(set(p) for p in arms.values()))) if arms else []
    lines = [
        "| generations | arm | validation | gain (SE) | KL(base‖tuned) | KL(SFT‖tuned) | "
        "‖ΔW‖/‖W0‖ |",
        "|---|---|---|---|---|---|---|",
    ]
    for g in common:
        for arm, by_generation in arms.items():
            r = by_generation[g]
            lines.append(
                f"| {g + 1} | {arm} | {r['val_accuracy']:.3f} | {r['val_gain']:+.3f} "
                f"({r['val_se']:.3f}) | {r['drift_kl_base']:.4f} | {r['drift_kl_sft']:.4f} | "
                f"{r['drift_update']:.4f} |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="a config file (default: the demo)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=list(ARMS))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reuse", action="store_true", help="keep finished runs under --root")
    parser.add_argument("--root", default="runs/bench-drift-budget")
    parser.add_argument("--out", default="drift_budget")
    parser.add_argument("--passes", action="store_true", help="tabulate the runs' checks only")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.passes:
        seed = args.seeds[0]
        root = Path(args.root)
        arms = {arm: pass_records(root / f"{run_name(arm)}-seed{seed}") for arm in args.arms}
        text = passes_table(arms)
        (RESULTS / f"{args.out}_passes.md").write_text(text + "\n")
        print(text)
        return
    runs = [r for seed in args.seeds for r in run_seed(args, seed)]
    summary = summarise(runs)
    command = ("python -m bench.studies.drift_budget " + " ".join(sys.argv[1:])).strip()
    write_result(args.out, {"runs": runs, "arms": summary}, command)
    (RESULTS / f"{args.out}.md").write_text(table(summary) + "\n")
    plot(runs, RESULTS / f"{args.out}.png")
    print(table(summary))


if __name__ == "__main__":
    main()
