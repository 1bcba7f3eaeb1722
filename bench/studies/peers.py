"""ESSA, our GRPO and TRL's GRPOTrainer side by side on the demo task: one table, one plot.

    python -m bench.studies.peers [--grpo-config configs/grpo_demo.yaml] [--seeds 0 1] [--set k=v ...]

Per seed, three fresh processes one after the other, each with ``--threads`` threads:
1. ESSA: `essa train --essa-config` (trains the SFT adapter and saves it in its run dir);
2. our GRPO: `essa train` on the GRPO config (default: the ESSA config with
   ``algorithm=grpo``, 8 prompts x G=8 per step; ``--grpo-config configs/grpo_demo.yaml`` is
   the equal-generated-token budget, 64 x 16 per step) from ESSA's SFT adapter
   (``adapter.path``), so all three start from the very same weights;
3. TRL: `python -m bench.studies.trl_grpo` on the same GRPO config and SFT adapter (see that module
   for the settings mapped and the mismatches left).
``--set`` overrides go to all three (e.g. ``run.generations=30``). Every run writes our
metrics.jsonl/summary.json, so the curves (held-out accuracy vs cumulative training seconds and
generated tokens; SFT and held-out evaluation excluded) come from essa.compare for all three.
Peak RSS is each process's own VmHWM. Writes bench/results/peers.{json,md,png} (the plot and
table of the first seed; the JSON has every seed plus medians and spread).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.common import RESULTS, compact_png, fmt_spread, launch, median_spread, row, write_result

NAMES = ("essa", "grpo", "trl")


def commands(args: argparse.Namespace, seed: int, root: Path) -> dict[str, list[str]]:
    """The three command lines of one seed (GRPO and TRL read ESSA's SFT adapter)."""
    common = [f"run.seed={seed}", "run.show_progress=false", *args.overrides]
    grpo_config = args.grpo_config or args.essa_config
    grpo_sets = [
        *([] if args.grpo_config else ["algorithm=grpo"]),
        f"adapter.path={root / 'essa' / 'sft_adapter'}",
        *common,
    ]

    def essa_train(config: Path, run_dir: Path, sets: list[str]) -> list[str]:
        cmd = [sys.executable, "-m", "essa.cli", "train", str(config), "--overwrite",
               "--run-dir", str(run_dir), "--set", f"model.num_threads={args.threads}"]  # fmt: skip
        return cmd + [x for s in sets for x in ("--set", s)]

    trl = [sys.executable, "-m", "bench.studies.trl_grpo", "--no-result", "--threads", str(args.threads),
           "--config", str(grpo_config), "--run-dir", str(root / "trl")]  # fmt: skip
    return {
        "essa": essa_train(args.essa_config, root / "essa", common),
        "grpo": essa_train(grpo_config, root / "grpo", grpo_sets),
        "trl": trl + [x for s in grpo_sets if s != "algorithm=grpo" for x in ("--set", s)],
    }


def run_metrics(curves: Any, target: float) -> dict[str, Any]:
    """The table's numbers of one run (from essa.compare's curves)."""
    s = curves.summary
    reached = next(((sec, tok) for sec, tok, acc in curves.accuracy if acc >= target), None)
    seconds, tokens = (
        (curves.accuracy[-1][0], curves.accuracy[-1][1]) if curves.accuracy else (0, 0)
    )
    return {
        "label": curves.label,
        "sft_start": s.get("baseline_accuracy"),
        "final": s.get("final_accuracy"),
        "best": max((acc for _, _, acc in curves.accuracy), default=None),
        "train_seconds_to_target": None if reached is None else round(reached[0], 1),
        "tokens_to_target": None if reached is None else int(reached[1]),
        "train_seconds": round(seconds, 1),
        "tokens": int(tokens),
        "wall_seconds": s.get("wall_seconds"),
        "peak_rss_mb": s.get("peak_rss_mb"),
    }


def summarize(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and spread over seeds of each algorithm's numbers (None where never reached)."""
    out: dict[str, Any] = {}
    for name in NAMES:
        out[name] = {}
        for key in ("final", "best", "train_seconds_to_target", "tokens_to_target",
                    "train_seconds", "tokens", "wall_seconds", "peak_rss_mb"):  # fmt: skip
            values = [s["runs"][name][key] for s in seeds]
            reached = [v for v in values if v is not None]
            out[name][key] = median_spread(reached) if reached else None
            if key.endswith("_to_target"):
                out[name][key + "_reached"] = f"{len(reached)}/{len(values)}"
    return out


def run_seed(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    from essa.compare import load_run, plot, table

    root = args.runs / f"seed{seed}"
    root.mkdir(parents=True, exist_ok=True)
    walls = {}
    for name, cmd in commands(args, seed, root).items():
        print(f"seed {seed}: {name} ...", flush=True)
        walls[name] = launch(cmd, root / f"{name}.log", args.threads)
    curves = [load_run(root / name) for name in NAMES]
    runs = {name: run_metrics(c, args.target) for name, c in zip(NAMES, curves, strict=True)}
    for name in NAMES:
        runs[name]["process_wall_seconds"] = walls[name]
    text = table(curves, args.target)
    if seed == args.seeds[0]:
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "peers.md").write_text(text + "\n")
        plot(curves, args.output / "peers.png")
        compact_png(args.output / "peers.png")
    return {"seed": seed, "runs": runs, "table": text}


def report_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows for docs/performance.md (bench/suite.py)."""
    s = result["summary"]
    target = result["target"]

    def three(key: str, digits: int, unit: str = "") -> str:
        parts = []
        for name in NAMES:
            stats = s[name][key]
            text = "never" if stats is None else fmt_spread(stats, digits, unit)
            if key.endswith("_to_target"):
                text += f" ({s[name][key + '_reached']} seeds)"
            parts.append(text)
        return " / ".join(parts)

    rss = {name: s[name]["peak_rss_mb"]["median"] for name in NAMES}
    note = "ESSA / our GRPO / TRL GRPOTrainer, median [min-max] over seeds; measured under load"
    return [
        row("Demo task, final held-out accuracy", three("final", 3), note=note),
        row(
            f"Demo task, training seconds to held-out {target:g}",
            three("train_seconds_to_target", 1, " s"),
            note=note,
        ),  # fmt: skip
        row(
            f"Demo task, generated tokens to held-out {target:g}",
            three("tokens_to_target", 0),
            note=note,
        ),  # fmt: skip
        row("Demo task, generated tokens (whole run)", three("tokens", 0), note=note),
        row(
            "Demo task, peak RSS (whole process): ESSA / GRPO, our GRPO / TRL",
            f"{rss['essa'] / rss['grpo']:.2f}x, {rss['grpo'] / rss['trl']:.2f}x",
            note=f"MB: {rss['essa']:.0f} / {rss['grpo']:.0f} / {rss['trl']:.0f}; "
            "dominated by the libraries on this 2.6M-parameter model",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--essa-config", type=Path, default=Path("configs/demo.yaml"))
    parser.add_argument("--grpo-config", type=Path, default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--runs", type=Path, default=Path("runs/bench-peers"))
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--output", type=Path, default=RESULTS, help="for peers.md and .png")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    seeds = [run_seed(args, seed) for seed in args.seeds]
    command = (
        f"python -m bench.studies.peers --threads {args.threads} --seeds {' '.join(map(str, args.seeds))}"
        + (f" --grpo-config {args.grpo_config}" if args.grpo_config else "")
        + f" --target {args.target:g}"
        + "".join(f" --set {o}" for o in args.overrides)
    )
    result = {
        "seeds": args.seeds,
        "target": args.target,
        "essa_config": str(args.essa_config),
        "grpo_config": str(args.grpo_config or f"{args.essa_config} + algorithm=grpo"),
        "overrides": args.overrides,
        "per_seed": seeds,
        "summary": summarize(seeds),
    }
    path = write_result("peers", result, command, extra_versions=("trl",))
    print(seeds[0]["table"])
    for line in report_rows(json.loads(path.read_text())):
        print(f"{line['row']}: {line['value']}")
    print(f"-> {path} (reproduce: {command})")


if __name__ == "__main__":
    main()
