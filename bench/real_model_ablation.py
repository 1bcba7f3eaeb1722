"""Signal per CPU-second on the real model (issue 15, deliverable 2): one change at a time.

    python -m bench.real_model_ablation [--task chain_sum] [--seeds 0 1 2] [--arms ...]

Each arm is a whole ``essa train`` of bench/real_model.py's task config (SFT, scale baseline,
search, final held-out; the same 20-minute budget) with one setting changed from the shipped
``configs/smollm2.yaml``. The default arm is bench/real_model.py's own ESSA run of the seed and is
reused from its ``--root`` when it has finished there (``--reuse``). Each arm is compared with
the default arm of the same seed on the same held-out items (paired), and its held-out gain
over its own SFT adapter per wall-minute (2 cores) is reported.

Writes bench/results/real_model_ablation.json and .md (chain_sum), or
real_model_ablation_<task>.json and .md for another task.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.common import write_result
from bench.real_model import TASKS, essa_seed, paired, task_config

RESULTS = Path("bench/results")
ARMS: dict[str, list[str]] = {
    "default": [],
    "no_tie_breaker": ["reward.reference_weight=0"],  # correctness alone ranks
    "not_mirrored": ["optimizer.mirrored=false"],
    "start_sft": ["optimizer.start=sft"],  # the search starts at the SFT adapter itself
    "more_prompts": ["data.batch_size=64", "optimizer.population_size=8"],  # same rows
    "longer_sft": ["sft.steps=48"],
    # Memory: 128 rows per forward instead of the population's 512 (peak RSS vs speed)
    "small_micro_batch": ["evaluation.micro_batch_size=128"],
    # Hansen's escape from flat fitness: sigma x1.22 when the task reward ties the top 70%
    "escape_flat": ["optimizer.escape_flat_reward=true"],
}


def gain_per_minute(run: dict[str, Any]) -> float:
    return run["essa_vs_sft"]["gain"] / (run["summary"]["wall_seconds"] / 60)


def summarise(arm: list[dict], default: list[dict]) -> dict[str, Any]:
    diffs = [
        paired(a["scores"]["final"], d["scores"]["final"])
        for a, d in zip(arm, default, strict=True)
    ]
    return {
        "final": statistics.mean(r["accuracy"]["final"] for r in arm),
        "sft": statistics.mean(r["accuracy"]["sft"] for r in arm),
        "gain_over_sft": statistics.mean(r["essa_vs_sft"]["gain"] for r in arm),
        "gain_per_minute": statistics.mean(gain_per_minute(r) for r in arm),
        "vs_default": statistics.mean(d["gain"] for d in diffs),
        "vs_default_se": math.sqrt(sum(d["se"] ** 2 for d in diffs)) / len(diffs),
        "wall_seconds": [r["summary"]["wall_seconds"] for r in arm],
        "peak_rss_mb": [r["summary"].get("peak_rss_mb") for r in arm],
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| arm | change | SFT | final | gain over SFT | gain per minute | vs default (paired SE) |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, s in result["summary"].items():
        change = ", ".join(f"`{c}`" for c in ARMS[arm]) or "(configs/smollm2.yaml)"
        vs = "-" if arm == "default" else f"{s['vs_default']:+.3f} ({s['vs_default_se']:.3f})"
        lines.append(
            f"| {arm} | {change} | {s['sft']:.3f} | {s['final']:.3f} | {s['gain_over_sft']:+.3f} "
            f"| {s['gain_per_minute']:+.4f} | {vs} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="chain_sum", choices=list(TASKS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--root", default="runs/bench-real-model")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs under --root")
    args = parser.parse_args()
    root = Path(args.root) / args.task
    config = task_config(args.task, TASKS[args.task], root)
    arms = ["default", *(a for a in args.arms if a != "default")]
    runs: dict[str, list[dict]] = {}
    for arm in arms:
        runs[arm] = []
        for seed in args.seeds:
            print(f"[ablation] {args.task} {arm} seed {seed} ...", flush=True)
            name = "essa" if arm == "default" else f"ablation-{arm}"
            run = essa_seed(config, seed, root, ARMS[arm], args.threads, args.reuse, name)
            print(f"[ablation] {arm} seed {seed}: SFT {run['accuracy']['sft']:.3f} -> "
                  f"{run['accuracy']['final']:.3f} in {run['summary']['wall_seconds']:.0f} s",
                  flush=True)  # fmt: skip
            runs[arm].append(run)
    result = {
        "task": args.task,
        "arms": {a: ARMS[a] for a in arms},
        "summary": {a: summarise(runs[a], runs["default"]) for a in arms},
        "runs": {
            a: [{k: v for k, v in r.items() if k != "scores"} for r in rs] for a, rs in runs.items()
        },  # fmt: skip
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.real_model_ablation " + " ".join(sys.argv[1:])
    stem = "real_model_ablation" + ("" if args.task == "chain_sum" else f"_{args.task}")
    write_result(stem, result, command.strip())
    (RESULTS / f"{stem}.md").write_text(table(result) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
