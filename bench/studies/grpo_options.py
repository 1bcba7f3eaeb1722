"""The gradient backend's seed-method options on the demo, each beside plain GRPO, 3 seeds.

    python -m bench.studies.grpo_options [--seeds 0 1 2] [--budget 75] [--options replay ...]

Every run is ``essa train`` on the embedded demo (its SFT adapter, 8 prompts x G=8 per step,
lr 1e-3 held constant) in a fresh process with the same wall-clock budget
(``run.max_wall_seconds``, default 75 s of the whole run, the demo's few-second SFT and held-out
baseline included; the step count is open), so an option that costs more per step gets fewer steps, as it would
for a user with a deadline. Held-out accuracy is measured before and after on the demo's 1000
fixed pairs; each option's final adapter is compared with plain GRPO's of the same seed item by
item (paired; per-item scores from each run's ``heldout_scores.jsonl``). Writes
bench/results/grpo_options.json and grpo_options.md (the table in docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.common import RESULTS, launch, read_result, write_result
from bench.studies.common import over_seeds, paired, passes

COMMON = [
    "algorithm=grpo",
    "grpo.lr_schedule=constant",  # the step count is set by the budget, not known up front
    "evaluation.every=0",  # held-out before and after only: evaluations would eat the budget
    "run.generations=100000",
    "run.show_progress=false",
]
OPTIONS: dict[str, list[str]] = {
    "grpo": [],
    "rlep_replay": ["grpo.replay.capacity=512", "grpo.replay.ratio=0.25"],
    "entropy_bonus": ["grpo.entropy.coef=0.01"],
    "era_floor": ["grpo.entropy.floor=0.3"],
    "temperature_stages": ["grpo.temperature_schedule=[[0, 1.2], [20, 1.0], [40, 0.8]]"],
    "cure": ["grpo.cure.use_branching=true", "grpo.cure.branches=3", "grpo.group_size=8"],
    "dpo_online": ["algorithm=dpo", "dpo.lr_schedule=constant"],
    "one_shot": ["grpo.train_examples=1", "grpo.entropy.coef=0.01"],
    # An SFT-stage method, from the base model rather than the SFT adapter: LISA SFT over a clean
    # and a pure-noise source (the training pool's answers shuffled), weights learned.
    "scalebio_mixture": ["algorithm=scalebio", "scalebio.lr=1e-4", "scalebio.weight_lr=5",
                         "data.sources={{clean: {root}/clean.jsonl, noise: {root}/noise.jsonl}}"],
}  # fmt: skip


def write_sources(root: Path) -> None:
    """ScaleBiO's two sources from the demo's training pool: right answers, shuffled answers."""
    import numpy as np

    from essa.data.loaders import builtin_examples

    train, _ = builtin_examples("builtin:arithmetic")
    order = np.random.default_rng(0).permutation(len(train))
    clean, noisy = [train[i] for i in order[:300]], [train[i] for i in order[300:600]]
    shuffled = [noisy[i].answer for i in np.random.default_rng(1).permutation(len(noisy))]
    for name, pairs in (
        ("clean", [(e.prompt, e.answer) for e in clean]),
        ("noise", [(e.prompt, a) for e, a in zip(noisy, shuffled, strict=True)]),
    ):
        lines = (json.dumps({"question": q, "answer": a}) + "\n" for q, a in pairs)
        (root / f"{name}.jsonl").write_text("".join(lines))  # fmt: skip


def run(
    option: str, seed: int, budget: int, root: Path, threads: int, reuse: bool = False
) -> dict[str, Any]:
    run_dir = root / option / f"seed{seed}"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    options = [o.format(root=root.resolve()) for o in OPTIONS[option]]
    sets = [*COMMON, f"run.seed={seed}", f"run.max_wall_seconds={budget}", *options]
    cmd = [sys.executable, "-m", "essa.cli", "train", "--overwrite", "--run-dir", str(run_dir)]
    cmd += [x for s in sets for x in ("--set", s)]
    done = reuse and (run_dir / "summary.json").exists()
    wall = None if done else launch(cmd, run_dir.parent / f"seed{seed}.log", threads)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "seed": seed,
        "command_wall_seconds": wall,
        "steps": summary.get("generations"),
        "sft": summary["baseline_accuracy"],
        "final": summary["final_accuracy"],
        "scores": passes(run_dir)["final"],
    }


def summarise(runs: list[dict], plain: list[dict]) -> dict[str, Any]:
    diffs = [paired(r["scores"], p["scores"]) for r, p in zip(runs, plain, strict=True)]
    vs_grpo = over_seeds(diffs)
    return {
        "final": statistics.mean(r["final"] for r in runs),
        "per_seed_final": [r["final"] for r in runs],
        "steps": [r["steps"] for r in runs],
        "vs_grpo": vs_grpo["gain"],
        "vs_grpo_se": vs_grpo["se"],
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| option | held-out (mean of seeds) | per seed | steps in the budget | vs plain GRPO "
        "(paired SE) |",
        "|---|---|---|---|---|",
    ]
    order = sorted(result["summary"], key=lambda o: o != "grpo")  # the reference row first
    for option in order:
        s = result["summary"][option]
        per_seed = ", ".join(f"{v:.3f}" for v in s["per_seed_final"])
        steps = ", ".join(str(v) for v in s["steps"])
        vs = "-" if option == "grpo" else f"{s['vs_grpo']:+.3f} ({s['vs_grpo_se']:.3f})"
        lines.append(f"| `{option}` | {s['final']:.3f} | {per_seed} | {steps} | {vs} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--budget", type=int, default=75)
    parser.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--root", default="runs/bench-grpo-options")
    parser.add_argument(
        "--reuse-grpo", action="store_true", help="reuse finished plain-GRPO runs under --root"
    )
    args = parser.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    write_sources(root)
    options = ["grpo", *(o for o in args.options if o != "grpo")]  # the reference runs first
    runs: dict[str, list[dict]] = {}
    for option in options:
        runs[option] = []
        for seed in args.seeds:
            print(f"[grpo_options] {option} seed {seed} ...", flush=True)
            reuse = args.reuse_grpo and option == "grpo"
            r = run(option, seed, args.budget, root, args.threads, reuse)
            print(f"[grpo_options] {option} seed {seed}: {r['sft']:.3f} -> {r['final']:.3f} "
                  f"in {r['steps']} steps", flush=True)  # fmt: skip
            runs[option].append(r)
    # Options not rerun keep their recorded rows when the budget matches (one table).
    previous = read_result("grpo_options") or {}
    if previous.get("budget_seconds") != args.budget:
        previous = {}
    kept = [o for o in previous.get("summary", {}) if o not in runs]
    fresh_runs = {o: [{k: v for k, v in r.items() if k != "scores"} for r in rs]
                  for o, rs in runs.items()}  # fmt: skip
    result: dict[str, Any] = {
        "budget_seconds": args.budget,
        "options": {**{o: previous["options"][o] for o in kept}, **{o: OPTIONS[o] for o in runs}},
        "common": COMMON,
        "summary": {
            **{o: previous["summary"][o] for o in kept},
            **{o: summarise(runs[o], runs["grpo"]) for o in runs},
        },  # fmt: skip
        "runs": {**{o: previous["runs"][o] for o in kept}, **fresh_runs},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_result(
        "grpo_options", result, "python -m bench.studies.grpo_options " + " ".join(sys.argv[1:])
    )
    (RESULTS / "grpo_options.md").write_text(table(result) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
