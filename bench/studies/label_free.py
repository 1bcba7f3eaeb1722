"""Label-free ESSA on the embedded demo: TTRL's vote over the population and RLSC, 3 seeds.

    python -m bench.studies.label_free [--seeds 0 1 2] [--settings labelled pool rlsc] [--set k=v ...]

Each setting runs `essa train` on the embedded demo (its SFT adapter, CMA-ES, 150 generations)
once per seed in a fresh process, with only the reward changed:

* ``labelled``: ``math_accuracy`` against the reference answers (the demo as shipped);
* ``pool``: ``majority_vote`` with ``pool: population``: each candidate is rewarded for
  agreeing with the majority answer of all 16 candidates on each prompt; no labels are used;
* ``rlsc``: ``self_confidence`` (RLSC): the length-normalised probability of the candidate's
  own greedy completion; no labels are used.

Held-out accuracy is always measured with the true answers (``evaluation.metric`` defaults to
``math_accuracy`` for label-free rewards), on the demo's fixed 1000 held-out pairs. The gain of
each run over its SFT adapter is tested paired, item by item: both adapters are re-evaluated
with ``essa eval --output`` and the standard error of the mean per-item difference is reported
(per seed, and for the mean over seeds). The pool's ``majority_correct_share`` (how often the
population's vote equals the true answer; logged as a diagnostic, never used by the reward)
shows whether the vote locks in a wrong consensus. Writes bench/results/label_free.json and
bench/results/label_free.png (held-out accuracy per generation, each setting beside the
labelled run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import RESULTS, compact_png, read_result, write_result
from bench.studies.common import over_seeds, paired, train_demo

SETTINGS: dict[str, list[str]] = {
    "labelled": [],
    "pool": ["reward.name=majority_vote", "reward.params.pool=population"],
    # TTRL's own setting: the vote is over sampled completions (here all candidates' k = 4
    # samples at temperature 1), so each candidate is rewarded for the share of its samples
    # that agree with the population's mode, not for agreeing with its greedy neighbours.
    "pool_sampled": [
        "reward.name=majority_vote",
        "reward.params.pool=population",
        "generation.temperature=1.0",
        "generation.samples_per_prompt=4",
    ],
    "rlsc": ["reward.name=self_confidence"],
}
COMMON = ["evaluation.use_scale_baseline=false"]  # the no-search baseline needs labels to mean much


def eval_paired(run_dir: Path) -> dict[str, float]:
    """Per-item held-out scores of the SFT adapter and the final adapter: mean gain and its SE."""
    scores = {}
    for name in ("sft_adapter", "adapter"):
        out = run_dir / f"eval-{name}.json"
        cmd = [sys.executable, "-m", "essa.cli", "eval", str(run_dir / "config.yaml"),
               "--adapter", str(run_dir / name), "--output", str(out)]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"essa eval failed:\n{res.stderr[-2000:]}")
        items = (run_dir / f"eval-{name}.items.jsonl").read_text().splitlines()
        scores[name] = [float(json.loads(line)["reward"] or 0.0) for line in items]
    return {
        "sft": statistics.mean(scores["sft_adapter"]),
        "final": statistics.mean(scores["adapter"]),
        **paired(scores["adapter"], scores["sft_adapter"]),
    }


def pool_trace(run_dir: Path) -> list[tuple[int, float, float]]:
    """(generation, majority_share, majority_correct_share) of a pool run."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "majority_share" in record:
            out.append(
                (record["generation"], record["majority_share"], record["majority_correct_share"])
            )
    return out


def summarise(runs: list[dict[str, Any]]) -> dict[str, float]:
    pooled = over_seeds([r["paired"] for r in runs])
    return {
        "sft": statistics.mean(r["paired"]["sft"] for r in runs),
        "final": statistics.mean(r["paired"]["final"] for r in runs),
        "gain": pooled["gain"],
        "se": pooled["se"],
        "z": pooled["z"],
        "per_seed_gain": [r["paired"]["gain"] for r in runs],
        "per_seed_z": pooled["per_seed_z"],
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| reward (labels used?) | SFT adapter | ESSA | gain (paired SE) | gain / SE | per seed |",
        "|---|---|---|---|---|---|",
    ]
    names = {
        "labelled": "math_accuracy (yes)",
        "pool": "majority_vote, pool: population, greedy (no)",
        "pool_sampled": "majority_vote, pool: population, k=4 samples at T=1 (no)",
        "rlsc": "self_confidence, RLSC (no)",
    }
    for setting, s in result["summary"].items():
        per_seed = ", ".join(f"{g:+.3f}" for g in s["per_seed_gain"])
        lines.append(
            f"| {names.get(setting, setting)} | {s['sft']:.3f} | {s['final']:.3f} | "
            f"{s['gain']:+.3f} ({s['se']:.3f}) | {s['z']:.1f} | {per_seed} |"
        )
    return "\n".join(lines)


def record_table(record: dict[str, Any]) -> str:
    """The table of a ``bench/results/label_free.json`` record (docs/results.md renders it)."""
    return table(record)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for setting, runs in result["runs"].items():
        for i, run in enumerate(runs):
            xs, ys = zip(*run["curve"], strict=True) if run["curve"] else ((), ())
            axes[0].plot(xs, ys, color=f"C{list(result['runs']).index(setting)}", alpha=0.8,
                         label=setting if i == 0 else None)  # fmt: skip
    axes[0].set_xlabel("generation")
    axes[0].set_ylabel("held-out accuracy (true answers)")
    axes[0].legend()
    for j, setting in enumerate(k for k in result["runs"] if k.startswith("pool")):
        for i, run in enumerate(result["runs"][setting]):
            trace = run["pool_trace"]
            if not trace:
                continue
            g, share, correct = zip(*trace, strict=True)
            style = "-" if j == 0 else "--"
            axes[1].plot(g, share, style, color="C1", alpha=0.6,
                         label=f"majority share ({setting})" if i == 0 else None)  # fmt: skip
            axes[1].plot(g, correct, style, color="C2", alpha=0.6,
                         label=f"vote = true answer ({setting})" if i == 0 else None)  # fmt: skip
    axes[1].set_xlabel("generation")
    axes[1].set_title("population pool: agreement vs correctness of the vote")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    compact_png(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--root", default="runs/bench-label-free")
    args = parser.parse_args()
    root = Path(args.root)
    fresh: dict[str, list[dict[str, Any]]] = {}
    for setting in args.settings:
        runs = []
        for seed in args.seeds:
            print(f"[label_free] {setting} seed {seed}: essa train ...", flush=True)
            run = train_demo(seed, [*COMMON, *SETTINGS[setting], *args.overrides], root / setting)
            run_dir = root / setting / f"seed{seed}"
            run["paired"] = eval_paired(run_dir)
            run["pool_trace"] = pool_trace(run_dir)
            p = run["paired"]
            print(f"[label_free] {setting} seed {seed}: {p['sft']:.3f} -> {p['final']:.3f} "
                  f"({p['gain']:+.3f}, SE {p['se']:.3f})", flush=True)  # fmt: skip
            runs.append(run)
        fresh[setting] = runs
    # Settings not rerun keep their recorded runs (one file, one table); read only now, so a
    # second invocation that finished meanwhile is kept too.
    previous = read_result("label_free") or {}
    kept = [k for k in previous.get("runs", {}) if k not in fresh]
    result: dict[str, Any] = {
        "runs": {**{k: previous["runs"][k] for k in kept}, **fresh},
        "summary": {
            **{k: previous["summary"][k] for k in kept},
            **{k: summarise(v) for k, v in fresh.items()},
        },  # fmt: skip
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = ("python -m bench.studies.label_free " + " ".join(sys.argv[1:])).strip()
    commands = previous.get("commands") or dict.fromkeys(kept, previous.get("command"))
    result["commands"] = {**{k: commands.get(k) for k in kept}, **dict.fromkeys(fresh, command)}
    write_result("label_free", result, command)
    plot(result, RESULTS / "label_free.png")
    print(table(result))


if __name__ == "__main__":
    main()
