"""Signal per CPU-second on the real model: one change at a time.

    python -m bench.studies.real_model_ablation [--task chain_sum] [--seeds 0 1 2] [--arms ...]

Each arm is a whole ``essa train`` of bench/studies/real_model.py's task config (SFT, scale baseline,
search, final held-out; the same 20-minute budget) with one setting changed from the shipped
``configs/smollm2.yaml``. The default arm is bench/studies/real_model.py's own ESSA run of the seed and is
reused from its ``--root`` when it has finished there (``--reuse``). Each arm is compared with
the default arm of the same seed on the same held-out items (paired), and its held-out gain
over its own SFT adapter per wall-minute (2 cores) is reported.

The per-prompt switches (GRESO, hints) on the real model are arms too (``pool_greso``, ``pool_hints``):
they act on a prompt's own history, which needs prompts that come back, so they and their
baseline ``pool`` train on a 128-prompt pool and are paired with ``pool``::

    python -m bench.studies.real_model_ablation --arms pool pool_greso --baseline pool \
        --out real_model_signal --reuse

Their rows also give rows generated, rows per point of held-out gain, bench.studies.signal's
rows-to-threshold ratio (baseline / arm) and the prompts skipped and hinted.

Where every run has a drift report (docs/drift.md), the table adds the final solutions'
off-task KL(base || tuned) and its ratio to the baseline arm's and to the archived GRPO runs'
of the same seeds (``bench.studies.real_model --grpo-seeds``, same SFT adapter), per-prompt pairs pooled
over seeds with a delta-method SE. The drift-budget arms (``drift_anchor``,
``drift_kl_penalty``) are measured that way::

    python -m bench.studies.real_model_ablation --arms drift_anchor --out real_model_drift_budget --reuse

An archived record is matched by its config with today's defaults filled in, so an arm whose
setting has since become the default would be restored from the older default run; ``--fresh``
runs the arms again and reuses only the baseline.

Writes bench/results/real_model_ablation.json and .md (chain_sum), or
real_model_ablation_<task>.json and .md for another task, or ``--out NAME``.json and .md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.common import RESULTS, write_result
from bench.studies.common import (
    ALL_TASKS,
    ARCHIVE,
    curve,
    essa_seed,
    geomean,
    paired,
    pooled_kl_ratio,
    read_archive,
    rows_per_step,
    rows_ratio,
    task_config,
)

POOL = ["data.train_size=128"]
ARMS: dict[str, list[str]] = {
    "default": [],
    "no_tie_breaker": ["reward.reference_weight=0"],  # correctness alone ranks
    "not_mirrored": ["optimizer.mirrored=false"],
    "start_sft": ["optimizer.start=sft"],  # the search starts at the SFT adapter itself
    "more_prompts": ["data.batch_size=64", "optimizer.population_size=8"],  # same rows
    # SFT length. The config ships 48 steps since `longer_sft` ran against 24-step default runs
    # (real_model_ablation_mb128); `short_sft` measures 24 steps against later default runs.
    "longer_sft": ["sft.steps=48"],
    "short_sft": ["sft.steps=24"],
    # Memory: 128 rows per forward instead of the population's 512 (peak RSS vs speed). The
    # config ships 128 since this arm ran; the recorded default runs (essa-seed*) predate that
    # and ran all 512 rows in one forward, which `one_forward` measures for new default runs.
    "small_micro_batch": ["evaluation.micro_batch_size=128"],
    "one_forward": ["evaluation.micro_batch_size=1024"],
    # Hansen's escape from flat fitness: sigma x1.22 when the task reward ties the top 70%
    "escape_flat": ["optimizer.escape_flat_reward=true"],
    # The scale baseline checks the tie-breaker against the reward on its factors and the search
    # drops it when they disagree. The archived default runs (essa-seed*) predate the check: run
    # this arm --fresh. fraction_simplification's record is the shipped check's; number_format's
    # ran an earlier form of it (a 2-SE test on the term's favourite factor).
    "reference_check": ["reward.reference_check=true"],
    # the tie-breaker reads each reference token's margin to the greedy choice, not its log-prob
    "margin": ["reward.reference_signal=margin"],
    # the margin kept whatever the check says (where the check drops it, `margin` runs without it)
    "margin_unchecked": ["reward.reference_signal=margin", "reward.reference_check=false"],
    # sampled completions under common random numbers: a prompt scores a fraction of 4 samples
    "sampled_crn": [
        "generation.temperature=1.0",
        "generation.samples_per_prompt=4",
        "data.batch_size=8",
    ],  # fmt: skip
    # base weights in bitsandbytes INT8: faster generations on CPU, different rounding
    "int8": ["model.quantization=int8"],
    # base weights in bfloat16 (the adapter's low-rank path stays float32): about 2x the fp32
    # matmul rate on a CPU with bfloat16 instructions (AVX512-BF16, AMX), far slower without
    "bf16": ["model.dtype=bfloat16"],
    # the search's drift budget (docs/drift-control.md): weight decay toward the SFT point, and a
    # penalty on the anchor set's off-task KL; compared on off-task KL too (below)
    "drift_anchor": ["optimizer.drift_budget.anchor=1"],
    "drift_kl_penalty": ["optimizer.drift_budget.kl_penalty=10"],
    # GRESO and hints on the real model: the per-prompt switches need prompts that come back, so these
    # arms share a 128-prompt training pool (35 generations x 32 prompts: ~9 visits each) and
    # are compared with `pool` (`--baseline pool`), not with the default's full pool, where a
    # prompt is drawn about once.
    "pool": POOL,
    "pool_greso": [*POOL, "data.selection.name=greso"],
    "pool_hints": [*POOL, "data.hints.after=2"],
}

ABLATION = [a for a in ARMS if not a.startswith(("pool", "drift"))]  # the default --arms


def gain_per_minute(run: dict[str, Any]) -> float:
    return run["essa_vs_sft"]["gain"] / (run["summary"]["wall_seconds"] / 60)


def prompt_signal(run_dir: Path, final: float) -> dict[str, Any]:
    """Rows generated, the held-out curve against rows (SFT, every pass, the final) and the
    per-prompt switches' counts, from the run's metrics.jsonl (what docs/informative-prompts.md measures)."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in records if m["generation"] >= 0]
    rows = sum(rows_per_step(run_dir, m) for m in steps)
    spread = [m["zero_spread_fraction"] for m in steps if "zero_spread_fraction" in m]
    return {
        "rows": rows,
        "curve": [*curve(run_dir), (rows, final)],
        "prompts_skipped": sum(m.get("prompts_skipped", 0) for m in steps),
        "rows_saved": sum(m.get("rows_saved", 0) for m in steps),
        "prompts_hinted": sum(m.get("prompts_hinted", 0) for m in steps),
        "zero_spread_fraction": statistics.mean(spread) if spread else None,
    }


def rows_summary(arm: list[dict], base: list[dict]) -> dict[str, Any]:
    """Rows per unit of held-out gain, and rows-to-threshold base / arm (bench.studies.signal's: the rows
    until the curve first reaches SFT + 90% of the baseline run's final gain, same seed)."""
    ratios = [
        rows_ratio(
            a["signal"]["curve"], b["signal"]["curve"], b["accuracy"]["sft"], b["accuracy"]["final"]
        )
        for a, b in zip(arm, base, strict=True)
    ]
    gain = sum(r["essa_vs_sft"]["gain"] for r in arm)
    return {
        "rows": statistics.mean(r["signal"]["rows"] for r in arm),
        # all seeds' rows over all seeds' gain (None when the arm gained nothing)
        "rows_per_gain": sum(r["signal"]["rows"] for r in arm) / gain if gain > 0 else None,
        "rows_to_threshold_ratio": ratios,
        "rows_to_threshold_geomean": geomean(ratios),
        **{
            k: statistics.mean(r["signal"][k] for r in arm)
            for k in ("prompts_skipped", "rows_saved", "prompts_hinted")
        },
    }


def summarise(
    arm: list[dict], default: list[dict], grpo: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    diffs = [
        paired(a["scores"]["final"], d["scores"]["final"])
        for a, d in zip(arm, default, strict=True)
    ]
    signal = all("signal" in r for r in [*arm, *default])
    return {
        **(rows_summary(arm, default) if signal else {}),
        "final": statistics.mean(r["accuracy"]["final"] for r in arm),
        "sft": statistics.mean(r["accuracy"]["sft"] for r in arm),
        "gain_over_sft": statistics.mean(r["essa_vs_sft"]["gain"] for r in arm),
        "gain_per_minute": statistics.mean(gain_per_minute(r) for r in arm),
        "vs_default": statistics.mean(d["gain"] for d in diffs),
        "vs_default_se": math.sqrt(sum(d["se"] ** 2 for d in diffs)) / len(diffs),
        "wall_seconds": [r["summary"]["wall_seconds"] for r in arm],
        "peak_rss_mb": [r["summary"].get("peak_rss_mb") for r in arm],
        "generations": [r["summary"].get("generations") for r in arm],  # done in the budget
        "drift": drift_summary(arm, default, grpo),
    }


def drift_reports(runs: list[dict]) -> list[dict[str, Any]] | None:
    """The final drift report of each run; None unless every run has per-prompt KL."""
    reports = [r["summary"].get("drift") or {} for r in runs]
    return reports if all("kl_per_prompt" in d for d in reports) else None


def archived_grpo(task: str, seeds: list[int]) -> list[dict[str, Any]] | None:
    """The drift reports of the archived GRPO runs of ``seeds`` (bench.studies.real_model's, from each
    seed's SFT adapter); None unless every seed has one."""
    records = read_archive(ARCHIVE / f"{task}.jsonl.xz")
    runs = []
    for seed in seeds:
        record = records.get(f"grpo-seed{seed}")
        if record is None:
            return None
        runs.append({"summary": json.loads(record["files"]["summary.json"])})
    return drift_reports(runs)


def drift_summary(
    arm: list[dict], base: list[dict], grpo: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """Mean off-task KL(base || tuned) and KL(SFT || tuned) of the arm's final solutions, and the
    KL ratio to the baseline arm's and to GRPO's ({} without drift reports)."""
    mine, theirs = drift_reports(arm), drift_reports(base)
    if mine is None:
        return {}
    out: dict[str, Any] = {
        "kl_base": statistics.mean(d["kl_base"] for d in mine),
        "kl_sft": statistics.mean(d["kl_sft"] for d in mine if "kl_sft" in d),
    }
    if theirs is not None:
        out["kl_vs_baseline"] = pooled_kl_ratio(mine, theirs)
    if grpo is not None:
        out["kl_vs_grpo"] = pooled_kl_ratio(mine, grpo)
        out["grpo_kl_base"] = statistics.mean(d["kl_base"] for d in grpo)
    return out


def _mean_or_dash(values: list[float | None], spec: str) -> str:
    known = [v for v in values if v is not None]
    return format(statistics.mean(known), spec) if known else "-"


def drift_cells(d: dict[str, Any], is_baseline: bool) -> str:
    def ratio(key: str) -> str:
        r = d.get(key)
        return "-" if r is None else f"{r['ratio']:.2f}x ± {r['se']:.2f}"

    vs_base = "-" if is_baseline else ratio("kl_vs_baseline")
    return f" {d['kl_base']:.3f} | {d['kl_sft']:.3f} | {vs_base} | {ratio('kl_vs_grpo')} |"


def table(result: dict[str, Any]) -> str:
    base = result.get("baseline", "default")
    signal = all("rows" in s for s in result["summary"].values())
    drift = all(s.get("drift") for s in result["summary"].values())
    extra = " rows per point of gain | rows-to-threshold (per seed) | skipped | hinted |"
    extra_drift = f" KL(base‖tuned) | KL(SFT‖tuned) | KL vs {base} | KL vs GRPO |"
    lines = [
        "| arm | change | SFT | final | gain over SFT | gain per minute | "
        f"vs {base} (paired SE) | generations | peak RSS MB |"
        + (extra if signal else "")
        + (extra_drift if drift else ""),
        "|---|---|---|---|---|---|---|---|---|"
        + ("---|---|---|---|" if signal else "")
        + ("---|---|---|---|" if drift else ""),
    ]
    for arm, s in result["summary"].items():
        change = ", ".join(f"`{c}`" for c in ARMS[arm]) or "(configs/smollm2.yaml)"
        vs = "-" if arm == base else f"{s['vs_default']:+.3f} ({s['vs_default_se']:.3f})"
        line = (
            f"| {arm} | {change} | {s['sft']:.3f} | {s['final']:.3f} | {s['gain_over_sft']:+.3f} "
            f"| {s['gain_per_minute']:+.4f} | {vs} "
            f"| {_mean_or_dash(s['generations'], '.1f')} | {_mean_or_dash(s['peak_rss_mb'], '.0f')} |"
        )
        if signal:
            per_gain = "-" if s["rows_per_gain"] is None else f"{s['rows_per_gain'] / 100:.0f}"
            ratios = ", ".join(
                "never" if x is None else f"{x:.2f}" for x in s["rows_to_threshold_ratio"]
            )
            geo = s["rows_to_threshold_geomean"]
            ratio = "-" if arm == base else (f"{geo:.2f}x ({ratios})" if geo else ratios)
            line += (
                f" {per_gain} | {ratio} | {s['prompts_skipped']:.0f} | {s['prompts_hinted']:.0f} |"
            )
        if drift:
            line += drift_cells(s["drift"], arm == base)
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="chain_sum", choices=list(ALL_TASKS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=ABLATION, choices=list(ARMS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--root", default="runs/bench-real-model")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs under --root")
    parser.add_argument("--baseline", default="default", choices=list(ARMS),
                        help="the arm every other arm is paired against")  # fmt: skip
    parser.add_argument("--out", help="results stem (default: real_model_ablation[_TASK])")
    parser.add_argument("--fresh", action="store_true",
                        help="run the arms even where --reuse finds them finished or archived "
                        "(an arm whose setting became the default matches the older default "
                        "runs' records); the baseline is still reused")  # fmt: skip
    args = parser.parse_args()
    root = Path(args.root) / args.task
    config = task_config(args.task, ALL_TASKS[args.task], root)
    arms = [args.baseline, *(a for a in args.arms if a != args.baseline)]
    runs: dict[str, list[dict]] = {}
    for arm in arms:
        runs[arm] = []
        for seed in args.seeds:
            print(f"[ablation] {args.task} {arm} seed {seed} ...", flush=True)
            name = "essa" if arm == "default" else f"ablation-{arm}"
            reuse = args.reuse and (arm == args.baseline or not args.fresh)
            run = essa_seed(config, seed, root, ARMS[arm], args.threads, reuse, name)
            print(f"[ablation] {arm} seed {seed}: SFT {run['accuracy']['sft']:.3f} -> "
                  f"{run['accuracy']['final']:.3f} in {run['summary']['wall_seconds']:.0f} s",
                  flush=True)  # fmt: skip
            run["signal"] = prompt_signal(Path(run["run_dir"]), run["accuracy"]["final"])
            runs[arm].append(run)
    grpo = archived_grpo(args.task, args.seeds)
    result = {
        "task": args.task,
        "arms": {a: ARMS[a] for a in arms},
        "baseline": args.baseline,
        "summary": {a: summarise(runs[a], runs[args.baseline], grpo) for a in arms},
        "runs": {
            a: [{k: v for k, v in r.items() if k != "scores"} for r in rs] for a, rs in runs.items()
        },  # fmt: skip
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.studies.real_model_ablation " + " ".join(sys.argv[1:])
    stem = args.out or "real_model_ablation" + ("" if args.task == "chain_sum" else f"_{args.task}")
    write_result(stem, result, command.strip())
    (RESULTS / f"{stem}.md").write_text(table(result) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
