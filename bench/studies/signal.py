"""Informative prompts and process rewards: each switch beside the same recipe off.

    python -m bench.studies.signal [--seeds 0 1 2] [--recipes essa grpo] [--switches greso ...]
                           [--pool N]

Every run is ``essa train`` on the embedded demo (its SFT adapter) in a fresh process, with a
fixed number of generations (ESSA) or steps (GRPO), so rows generated are equal across
switches by construction (GRESO refills the batch it skips from, docs/informative-prompts.md)
and accuracy is comparable at equal rows; held-out accuracy (500 fixed items, greedy) every few
steps gives the curve. Per run: the SFT start, the final accuracy (paired against the switch-off
run of the same seed on the same items), training rows generated (candidates x samples x
prompts, or groups x G x sampling rounds), the run's wall seconds (2 cores: a CPU-minute is
about a wall-minute on a quiet machine), and **rows to threshold**: the rows generated until the
held-out curve first reaches SFT + 90% of the switch-off run's final gain (same seed). The
headline ratio, rows-to-threshold off / on, is what "selective prompts reduce rows per unit of
held-out gain" means here.

The PRM (``--switches prm``) is bench/studies/tiny_prm.py's, trained in-process on the demo's training
pool (no PRM weights can be downloaded here; about 0.99 accuracy on 1000 training-pool items it
did not train on, written to the result); it is combined with the 0/1 outcome at weight 0.5.
It is not in the default switch list because training it adds about 2 minutes:
``--switches prm --out signal_prm`` measures it beside its own switch-off runs.

``--pool N`` trains on the first N training prompts only (``data.train_size``, both recipes):
the demo's pool of 9000 prompts is drawn 1536 (ESSA) or 960 (GRPO) times per run, so a prompt
is rarely seen twice and the switches, which act on a prompt's own history, have little to act
on; a small pool is revisited (N = 128: about 12 and 7 visits per prompt).

Writes bench/results/signal.json and signal.md (the table in docs/results.md), or signal_pool<N>.*, or
``--out NAME``.*.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.common import RESULTS, launch, write_result
from bench.studies.common import (
    curve,
    geomean,
    over_seeds,
    paired,
    passes,
    rows_per_step,
    rows_ratio,
)

COMMON = [
    "data.test_size=500",
    "evaluation.use_scale_baseline=false",
    "run.show_progress=false",
]
RECIPES: dict[str, list[str]] = {
    "essa": ["run.generations=24", "evaluation.every=3"],
    "grpo": ["algorithm=grpo", "grpo.lr_schedule=constant", "run.generations=120",
             "evaluation.every=10"],
}  # fmt: skip
PRM = ["reward.name=prm", "reward.params.prm={prm}", "reward.params.prm_weight=0.5",
       "reward.params.aggregate=min"]  # fmt: skip
SWITCHES: dict[str, list[str]] = {
    "off": [],
    "greso": ["data.selection.name=greso"],
    "hints": ["data.hints.after=2"],
    "prm": PRM,
    "prime": ["grpo.prime.enabled=true"],  # GRPO only
}
ONLY = {"prime": "grpo"}


def run(
    recipe: str, switch: str, seed: int, root: Path, prm: Path, threads: int, pool: list[str]
) -> dict:
    run_dir = root / recipe / switch / f"seed{seed}"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    own = [s.format(prm=prm) for s in SWITCHES[switch]]
    sets = [*COMMON, *pool, *RECIPES[recipe], f"run.seed={seed}", *own]
    cmd = [sys.executable, "-m", "essa.cli", "train", "--overwrite", "--run-dir", str(run_dir)]
    cmd += [x for s in sets for x in ("--set", s)]
    wall = launch(cmd, run_dir.parent / f"seed{seed}.log", threads)
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m["generation"] >= 0]
    return {
        "seed": seed,
        "command_wall_seconds": wall,
        "wall_seconds": summary["wall_seconds"],
        "sft": summary["baseline_accuracy"],
        "final": summary["final_accuracy"],
        "curve": curve(run_dir),
        "rows": sum(rows_per_step(run_dir, m) for m in steps),
        "prompts_skipped": sum(m.get("prompts_skipped", 0) for m in steps),
        "prompts_hinted": sum(m.get("prompts_hinted", 0) for m in steps),
        "scores": passes(run_dir)["final"],
    }


def summarise(runs: list[dict], off: list[dict]) -> dict[str, Any]:
    """The switch's runs against the switch-off runs of the same seeds."""
    diffs = [paired(r["scores"], o["scores"]) for r, o in zip(runs, off, strict=True)]
    ratios = [
        rows_ratio(r["curve"], o["curve"], o["sft"], o["final"])
        for r, o in zip(runs, off, strict=True)
    ]
    return {
        "final": statistics.mean(r["final"] for r in runs),
        "per_seed_final": [r["final"] for r in runs],
        "sft": statistics.mean(r["sft"] for r in runs),
        "vs_off": over_seeds(diffs)["gain"],
        "vs_off_se": over_seeds(diffs)["se"],
        "gain_per_minute": statistics.mean(
            (r["final"] - r["sft"]) / (r["wall_seconds"] / 60) for r in runs
        ),
        "rows": statistics.mean(r["rows"] for r in runs),
        "rows_ratio_per_seed": ratios,
        "rows_ratio_geomean": geomean(ratios),
        "prompts_skipped": statistics.mean(r["prompts_skipped"] for r in runs),
        "prompts_hinted": statistics.mean(r["prompts_hinted"] for r in runs),
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| recipe | switch | SFT | final (mean of seeds) | vs off (paired SE) | gain per "
        "minute | rows-to-threshold off / on (per seed) | skipped | hinted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for recipe, switches in result["summary"].items():
        for switch, s in switches.items():
            vs = "-" if switch == "off" else f"{s['vs_off']:+.3f} ({s['vs_off_se']:.3f})"
            ratios = ", ".join(
                "never" if x is None else f"{x:.2f}" for x in s["rows_ratio_per_seed"]
            )
            ratio = "-" if switch == "off" else (
                f"{s['rows_ratio_geomean']:.2f}x ({ratios})" if s["rows_ratio_geomean"] else ratios
            )  # fmt: skip
            lines.append(
                f"| {recipe} | `{switch}` | {s['sft']:.3f} | {s['final']:.3f} | {vs} | "
                f"{s['gain_per_minute']:+.3f} | {ratio} | {s['prompts_skipped']:.0f} | "
                f"{s['prompts_hinted']:.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument(
        "--switches", nargs="+", default=[s for s in SWITCHES if s != "prm"], choices=list(SWITCHES)
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--root", default="runs/bench-signal")
    parser.add_argument(
        "--pool",
        type=int,
        default=None,
        help="train on the first N training prompts only (data.train_size)",
    )
    parser.add_argument("--out", default=None, help="results name (default: signal[_poolN])")
    args = parser.parse_args()
    root = Path(args.root) if args.pool is None else Path(args.root) / f"pool{args.pool}"
    pool = [] if args.pool is None else [f"data.train_size={args.pool}"]
    name = args.out or ("signal" if args.pool is None else f"signal_pool{args.pool}")
    prm = root / "tiny-prm"
    if "prm" in args.switches:
        from bench.studies.tiny_prm import train_demo_prm

        print("[signal] training the tiny demo PRM ...", flush=True)
        prm_stats = train_demo_prm(prm)
        print(f"[signal] PRM held-back accuracy {prm_stats['held_back_accuracy']:.3f}", flush=True)
    else:
        prm_stats = None
    switches = ["off", *(s for s in args.switches if s != "off")]  # the reference runs first
    result: dict[str, Any] = {"common": [*COMMON, *pool], "recipes": RECIPES,
                              "switches": SWITCHES, "prm": prm_stats, "runs": {},
                              "summary": {}}  # fmt: skip
    command = "python -m bench.studies.signal " + " ".join(sys.argv[1:])
    for recipe in args.recipes:
        runs: dict[str, list[dict]] = {}
        for switch in switches:
            if ONLY.get(switch, recipe) != recipe:
                continue
            runs[switch] = []
            for seed in args.seeds:
                print(f"[signal] {recipe} {switch} seed {seed} ...", flush=True)
                r = run(recipe, switch, seed, root, prm, args.threads, pool)
                print(f"[signal] {recipe} {switch} seed {seed}: {r['sft']:.3f} -> "
                      f"{r['final']:.3f}, {r['rows']} rows, {r['wall_seconds']:.0f} s",
                      flush=True)  # fmt: skip
                runs[switch].append(r)
        result["summary"][recipe] = {s: summarise(rs, runs["off"]) for s, rs in runs.items()}
        result["runs"][recipe] = {
            s: [{k: v for k, v in r.items() if k != "scores"} for r in rs] for s, rs in runs.items()
        }
        RESULTS.mkdir(parents=True, exist_ok=True)
        write_result(name, result, command.strip())  # after each recipe: nothing lost
        (RESULTS / f"{name}.md").write_text(table(result) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
