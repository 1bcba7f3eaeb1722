"""Does ES drift more than GRPO? Gain, off-task KL and retention of ESSA (shipped and
drift-controlled) and GRPO, each from the same SFT adapter, on the real model.

    python -m bench.studies.drift_proof [--tasks chain_sum spell_backward fraction_simplification]
        [--seeds 0 1 2] [--arm "decay 0.05=optimizer.drift_budget.decay=0.05" ...]
        [--root runs/signal] [--reuse] [--out real_model_drift_proof]

Per task and seed, each in a fresh process from bench/studies/real_model.py's task config:

* ``essa``: ``essa train`` with ``configs/smollm2.yaml`` as shipped (the same run directory as
  bench.studies.real_model's under the same ``--root``, so ``--reuse`` takes its runs);
* one ``essa train`` per ``--arm NAME=KEY=VALUE[,KEY=VALUE]``, the drift control under test;
* ``grpo``: GRPO from the shipped ESSA run's own SFT adapter, data, reward and held-out items,
  with that run's wall-clock as its budget (bench.studies.real_model's GRPO run, reused alike).

Per task and recipe, pooled over the seeds: the held-out gain over the run's own SFT adapter
(paired SE), its share of the shipped ESSA run's gain, the off-task KL(base || tuned) of the
exported adapter on the drift report's prompts, its ratio to GRPO's (per-prompt pairs pooled over
the seeds, delta-method SE), and retention's change from the base model and from the SFT adapter
(docs/drift.md). The target (docs/drift-control.md): at >= 90% of the shipped gain, KL <= 1.0x
GRPO's on every task, retention no worse than GRPO's.

Writes bench/results/OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.common import RESULTS, write_result
from bench.studies import common
from bench.studies.common import (
    ALL_TASKS,
    essa_seed,
    grpo_needs_sft_adapter,
    grpo_seed,
    pooled,
    pooled_kl_ratio,
    retention_change,
    task_config,
)

TASKS = ["chain_sum", "spell_backward", "fraction_simplification"]
DEFAULT_ARMS = ["decay 0.05=optimizer.drift_budget.decay=0.05"]


def parse_arm(text: str) -> tuple[str, list[str]]:
    """``NAME=KEY=VALUE[,KEY=VALUE]`` -> (NAME, [KEY=VALUE, ...]).

    >>> parse_arm("decay 0.05=optimizer.drift_budget.decay=0.05")
    ('decay 0.05', ['optimizer.drift_budget.decay=0.05'])
    """
    name, _, sets = text.partition("=")
    if not name or "=" not in sets:
        raise argparse.ArgumentTypeError(f"--arm {text!r}: expected NAME=KEY=VALUE[,KEY=VALUE]")
    return name, sets.split(",")


def run_dir_name(arm: str) -> str:
    """The arm's run-directory prefix: ``drift-decay_0.05`` for ``decay 0.05``."""
    return "drift-" + "_".join(arm.split())


def task_runs(task: str, arms: dict[str, list[str]], args: argparse.Namespace) -> dict[str, list]:
    """Every seed's shipped ESSA run, each drift arm's run and GRPO's, for one task."""
    root = Path(args.root) / task
    config = task_config(task, ALL_TASKS[task], root)
    runs: dict[str, list[dict]] = {"essa": [], **{a: [] for a in arms}, "grpo": []}
    for seed in args.seeds:
        print(f"[drift_proof] {task} seed {seed}: essa train (shipped) ...", flush=True)
        shipped = essa_seed(config, seed, root, [], args.threads, args.reuse)
        for arm, overrides in arms.items():
            print(f"[drift_proof] {task} seed {seed}: essa train ({arm}) ...", flush=True)
            name = run_dir_name(arm)
            runs[arm].append(
                essa_seed(config, seed, root, overrides, args.threads, args.reuse, name)
            )
        if grpo_needs_sft_adapter(config, shipped, root, [], args.reuse):
            print(f"[drift_proof] {task} seed {seed}: the SFT adapter GRPO starts from is not on "
                  "disk: essa train again ...", flush=True)  # fmt: skip
            shipped = essa_seed(config, seed, root, [], args.threads)
        print(f"[drift_proof] {task} seed {seed}: grpo train ...", flush=True)
        runs["grpo"].append(grpo_seed(config, shipped, root, [], args.threads, args.reuse))
        runs["essa"].append(shipped)
    return runs


def gain_key(recipe: str) -> str:
    return "grpo_vs_sft" if recipe == "grpo" else "essa_vs_sft"


def summarise(runs: dict[str, list[dict]]) -> dict[str, dict[str, Any]]:
    """Per recipe: pooled gain over SFT, its share of the shipped ESSA gain, mean off-task KL,
    the KL ratio to GRPO (delta-method SE) and retention's change; KL figures are None where a
    run has no per-prompt drift report."""
    shipped = pooled(runs["essa"], "essa_vs_sft")["gain"]
    reports = {k: [r["summary"].get("drift") or {} for r in rs] for k, rs in runs.items()}
    with_kl = all("kl_per_prompt" in d for rs in reports.values() for d in rs)
    out: dict[str, dict[str, Any]] = {}
    for recipe, rs in runs.items():
        gain = pooled(rs, gain_key(recipe))
        out[recipe] = {
            "gain": gain["gain"],
            "gain_se": gain["se"],
            "share_of_shipped_gain": gain["gain"] / shipped if shipped > 0 else None,
            "kl_base": statistics.mean(d["kl_base"] for d in reports[recipe]) if with_kl else None,
            "kl_vs_grpo": pooled_kl_ratio(reports[recipe], reports["grpo"]) if with_kl else None,
            "retention": retention_change(rs),
            "wall_seconds": [r["summary"]["wall_seconds"] for r in rs],
        }
    return out


def run_record(recipe: str, run: dict[str, Any]) -> dict[str, Any]:
    """What the result keeps of one run (the per-item scores and reports stay in its directory)."""
    drift = run["summary"].get("drift") or {}
    return {
        "seed": run["seed"],
        "run_dir": run["run_dir"],
        "gain": run[gain_key(recipe)],
        "kl_base": drift.get("kl_base"),
        "retention": drift.get("retention"),
        "wall_seconds": run["summary"]["wall_seconds"],
        "exported": run["summary"].get("exported"),
    }


def meets_target(s: dict[str, Any]) -> str:
    """Yes when the arm keeps >= 90% of the shipped gain at KL <= 1.0x GRPO's."""
    share, ratio = s["share_of_shipped_gain"], s["kl_vs_grpo"]
    if share is None or ratio is None:
        return "-"
    return "yes" if share >= 0.9 and ratio["ratio"] <= 1.0 else "no"


def table(result: dict[str, Any]) -> str:
    lines = [
        "| task | recipe | gain over SFT (paired SE) | share of shipped ESSA's gain "
        "| off-task KL(base‖tuned) | KL / GRPO's (± SE) "
        "| retention change from base / SFT (runs x items) | >= 90% of the gain at <= 1.0x GRPO's KL |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for task, summary in result["tasks"].items():
        for recipe, s in summary.items():
            share, kl, ratio = s["share_of_shipped_gain"], s["kl_base"], s["kl_vs_grpo"]
            cells = [
                f"{s['gain']:+.3f} ({s['gain_se']:.3f})",
                "-" if share is None else f"{share:.0%}",
                "-" if kl is None else f"{kl:.3f}",
                "-" if ratio is None else f"{ratio['ratio']:.2f}x ± {ratio['se']:.2f}",
                s["retention"],
                "-" if recipe in ("essa", "grpo") else meets_target(s),
            ]
            lines.append(f"| {task} | {recipe} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=TASKS, choices=list(ALL_TASKS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arm", dest="arms", action="append", type=parse_arm,
                        help="NAME=KEY=VALUE[,KEY=VALUE]: a drift control (repeatable; default: "
                        f"{DEFAULT_ARMS[0]!r})")  # fmt: skip
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--root", default="runs/signal")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs under --root")
    parser.add_argument(
        "--no-restore",
        dest="restore",
        action="store_false",
        help="with --reuse, run what --root lacks instead of restoring it from the archive",
    )
    parser.add_argument("--out", default="real_model_drift_proof")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    common.RESTORE = args.restore
    arms = dict(args.arms or [parse_arm(a) for a in DEFAULT_ARMS])
    result: dict[str, Any] = {"arms": arms, "seeds": args.seeds, "tasks": {}, "runs": {}}
    for task in args.tasks:
        runs = task_runs(task, arms, args)
        result["tasks"][task] = summarise(runs)
        result["runs"][task] = {k: [run_record(k, r) for r in rs] for k, rs in runs.items()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.studies.drift_proof " + " ".join(sys.argv[1:])
    write_result(args.out, result, command.strip())
    (RESULTS / f"{args.out}.md").write_text(table(result) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
