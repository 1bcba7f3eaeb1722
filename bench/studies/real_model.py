"""ESSA on a real pretrained model: SmolLM2-135M-Instruct on reasoning-gym tasks, beside GRPO.

    python -m bench.studies.real_model [--seeds 0 1 2] [--tasks chain_sum ...] [--no-grpo]
                               [--grpo-tasks chain_sum ...] [--grpo-seeds 0 1 2]
                               [--set k=v] [--reuse [--no-restore]] [--out NAME]
    python -m bench.studies.real_model --tasks chain_sum --verify essa-seed0

For each task (reasoning-gym generators and scorers; nobody here wrote them) this runs, each in
a fresh process, from ``configs/smollm2.yaml`` with only the task swapped in:

* ``essa eval`` of the base model (no adapter) on the held-out split;
* per seed, ``essa train``: SFT of the rank-8 LoRA, the no-search scale baseline, CMA-ES over
  the adapter's singular values, the final held-out evaluation. Each run writes the per-item
  held-out scores of every pass (``heldout_scores.jsonl``), so the gains are tested *paired*
  on the same items: mean per-item difference and its standard error, per seed and pooled;
* with GRPO (on the first seed, or on ``--grpo-seeds``; each on that seed's ESSA run's own SFT
  adapter, data, reward and held-out items, ESSA - GRPO pooled over those seeds),
  ``algorithm: grpo`` with the same wall-clock budget: held-out accuracy against training
  seconds and generated tokens (``essa.compare``), and peak memory (RSS).

Writes bench/results/real_model.json, real_model.md (the table in docs/results.md; ``--out NAME``
writes NAME.json/.md instead), OUT_short.md (its headline columns, in the README), OUT_drift.md
(ESSA and GRPO drift reports per GRPO seed, in docs/drift-control.md) and one OUT_<task>.png per task
(the first GRPO seed's). Sizes
come from the config: held-out items per task (``--set data.test_size=N``), generations and the
20-minute budget (``run.max_wall_seconds``).
Everything the runs print goes to <root>/<task>/*.log.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import RESULTS, compact_png, write_result
from bench.studies import common
from bench.studies.common import (
    ALL_TASKS,
    ARCHIVE,
    CONFIG,
    EDGES,
    TASKS,
    UNTUNED,
    essa,
    essa_seed,
    full,
    grpo_needs_sft_adapter,
    grpo_seed,
    paired,
    pooled,
    pooled_kl_ratio,
    read_archive,
    retention_change,
    sets,
    task_config,
    timed,
)


def base_scores(
    config: Path, root: Path, overrides: list[str], threads: int, reuse: bool = False
) -> dict[str, Any]:
    """Held-out per-item scores of the base model (no adapter)."""
    out = root / "base_eval.json"
    keep = [out, root / "base_eval.items.jsonl"]
    seconds = timed(["eval", str(config), *sets(overrides), "--output", str(out)],
                    out, root / "base_eval.log", threads, reuse, keep)  # fmt: skip
    items = (root / "base_eval.items.jsonl").read_text().splitlines()
    return {"scores": [float(json.loads(x)["reward"] or 0.0) for x in items], "seconds": seconds}


def grpo_seeds(args: argparse.Namespace) -> list[int]:
    """The seeds GRPO runs beside ESSA on: ``--grpo-seeds``, by default the first of ``--seeds``
    (a GRPO run costs as much as the ESSA run it is timed against)."""
    return args.grpo_seeds if args.grpo_seeds else args.seeds[:1]


def report(task: str, run: dict) -> None:
    p = run["essa_vs_sft"]
    print(f"[real_model] {task} seed {run['seed']}: SFT {run['accuracy']['sft']:.3f} -> ESSA "
          f"{run['accuracy']['final']:.3f} ({p['gain']:+.3f}, paired SE {p['se']:.3f}), "
          f"{run['summary']['wall_seconds']:.0f} s", flush=True)  # fmt: skip


def run_task(task: str, args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.root) / task
    config = task_config(task, ALL_TASKS[task], root)
    print(f"[real_model] {task}: base model eval ...", flush=True)
    base = base_scores(config, root, args.overrides, args.threads, args.reuse)
    runs = []
    for seed in args.seeds:
        print(f"[real_model] {task} seed {seed}: essa train ...", flush=True)
        runs.append(essa_seed(config, seed, root, args.overrides, args.threads, args.reuse))
        report(task, runs[-1])
    with_grpo = args.grpo and task in (args.grpo_tasks or ALL_TASKS)
    wanted = grpo_seeds(args) if with_grpo else []
    grpo_at = [i for i, r in enumerate(runs) if r["seed"] in wanted]
    for i in grpo_at:
        if grpo_needs_sft_adapter(config, runs[i], root, args.overrides, args.reuse):
            print(f"[real_model] {task} seed {runs[i]['seed']}: the SFT adapter GRPO starts from "
                  "is not on disk (a restored run keeps no weights): essa train again ...",
                  flush=True)  # fmt: skip
            runs[i] = essa_seed(config, runs[i]["seed"], root, args.overrides, args.threads)
            report(task, runs[i])
    result: dict[str, Any] = {
        "params": ALL_TASKS[task],
        "base_accuracy": statistics.mean(base["scores"]),
        "base_full_credit": statistics.mean(full(base["scores"])),
        "base_eval_seconds": base["seconds"],
        "essa": runs,
        "essa_vs_sft": pooled(runs, "essa_vs_sft"),
        "essa_vs_sft_full_credit": pooled(runs, "essa_vs_sft_full_credit"),
        "essa_vs_base": [paired(r["scores"]["final"], base["scores"]) for r in runs],
    }
    grpo_runs = []
    for i in grpo_at:
        print(f"[real_model] {task} seed {runs[i]['seed']}: grpo train ...", flush=True)
        grpo_runs.append(grpo_seed(config, runs[i], root, args.overrides, args.threads, args.reuse))
    if grpo_runs:
        result["grpo_runs"] = grpo_runs
        result["essa_vs_grpo"] = pooled(grpo_runs, "essa_vs_grpo")
        plot_task(task, runs[grpo_at[0]], grpo_runs[0], RESULTS / f"{args.out}_{task}.png")
    for run in runs:  # per-item scores stay in the run directories
        run.pop("scores")
    return result


def plot_task(task: str, essa_run: dict, grpo: dict, path: Path) -> None:
    """Held-out accuracy against training seconds and generated tokens, ESSA beside GRPO."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from essa.compare import load_run

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for run in (essa_run, grpo):
        curves = load_run(Path(run["run_dir"]))
        peak = run["summary"].get("peak_rss_mb")
        label = f"{curves.label} (peak RSS {peak:.0f} MB)" if peak else curves.label
        if curves.accuracy:
            s, tokens, acc = zip(*curves.accuracy, strict=True)
            axes[0].plot(s, acc, marker="o", label=label)
            axes[1].plot(tokens, acc, marker="o", label=label)
    axes[0].set_xlabel("training seconds (2 CPU cores)")
    axes[1].set_xlabel("generated tokens")
    for ax in axes:
        ax.set_ylabel("held-out accuracy")
        ax.legend()
    fig.suptitle(f"SmolLM2-135M-Instruct, reasoning-gym {task}, seed {essa_run['seed']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    compact_png(path)


def mean_accuracy(runs: list[dict], key: str) -> float | None:
    """Mean over seeds of one held-out pass's accuracy; None when a run lacks it."""
    values = [r["accuracy"].get(key) for r in runs]
    return None if None in values else statistics.mean(v for v in values if v is not None)


def grpo_runs_of(t: dict[str, Any]) -> list[dict[str, Any]]:
    """A task's GRPO runs: `grpo_runs`, or the single `grpo` run of older records."""
    return t.get("grpo_runs") or ([t["grpo"]] if "grpo" in t else [])


def grpo_cells(t: dict[str, Any]) -> tuple[str, str]:
    """The table's GRPO cells: GRPO's final held-out and ESSA - GRPO paired on each GRPO seed's
    items (pooled over those seeds), and the peak RSS of ESSA and GRPO (means over the same
    seeds); "-" without GRPO. A result of one GRPO seed (older records) reads as before."""
    grpo_runs = grpo_runs_of(t)
    if not grpo_runs:
        return "-", "-"
    diff = t.get("essa_vs_grpo", grpo_runs[0]["essa_vs_grpo"])
    final = statistics.mean(g["accuracy"]["final"] for g in grpo_runs)
    seeds = f", {len(grpo_runs)} seeds" if len(grpo_runs) > 1 else ""
    grpo = f"{final:.3f} (ESSA {diff['gain']:+.3f} ± {diff['se']:.3f}{seeds})"
    essa_by_seed = {r.get("seed"): r for r in t["essa"]}
    pairs = [(essa_by_seed[g.get("seed")]["summary"].get("peak_rss_mb"),
              g["summary"].get("peak_rss_mb")) for g in grpo_runs]  # fmt: skip
    if not all(e and g for e, g in pairs):
        return grpo, "-"
    e_mem = statistics.mean(e for e, _ in pairs)
    g_mem = statistics.mean(g for _, g in pairs)
    return grpo, f"{e_mem:.0f} / {g_mem:.0f} MB ({e_mem / g_mem:.2f}x)"


def drift_cells(t: dict[str, Any]) -> str:
    """The table's off-task KL cell, on the GRPO seeds: KL(base || tuned) of ESSA and of GRPO
    with their ratio (per-prompt pairs pooled over seeds, delta-method SE); "-" without GRPO
    runs or where a record has no drift report."""
    if not grpo_runs_of(t):
        return "-"
    essa_by_seed = {r.get("seed"): r for r in t["essa"]}
    kl: dict[str, list[float]] = {"essa": [], "grpo": []}
    paired_reports: dict[str, list[dict[str, Any]]] = {"essa": [], "grpo": []}
    for g in grpo_runs_of(t):
        reports = {"essa": essa_by_seed[g.get("seed")]["summary"].get("drift") or {},
                   "grpo": g["summary"].get("drift") or {}}  # fmt: skip
        if not all("kl_per_prompt" in r for r in reports.values()):
            return "-"
        for k, r in reports.items():
            paired_reports[k].append(r)
            kl[k].append(r["kl_base"])
    r = pooled_kl_ratio(paired_reports["essa"], paired_reports["grpo"])
    return (f"{statistics.mean(kl['essa']):.4f} / {statistics.mean(kl['grpo']):.4f} "
            f"({r['ratio']:.2f}x ± {r['se']:.2f})")  # fmt: skip


def retention_cell(t: dict[str, Any]) -> str:
    """Retention's change from the base model and from the SFT adapter, ESSA's over its seeds
    and GRPO's over its own (:func:`~bench.studies.common.retention_change`)."""
    return f"{retention_change(t['essa'])}; {retention_change(grpo_runs_of(t))}"


def drift_table(result: dict[str, Any]) -> str:
    """Per GRPO seed, ESSA's and GRPO's drift reports side by side (both from the seed's SFT
    adapter): gains over SFT, off-task KL to the base and SFT models, the final update's mean
    ||dW|| / ||W0||, pass@K and retention's change from the base model and from SFT; "" when no
    record has them."""
    lines = [
        "| task | seed | gain over SFT ESSA / GRPO | KL(base‖SFT) | KL(base‖tuned) ESSA / GRPO "
        "| KL(SFT‖tuned) ESSA / GRPO | ‖ΔW‖/‖W0‖ ESSA / GRPO | pass@K ESSA / GRPO "
        "| retention change from base / SFT (runs x items) ESSA; GRPO |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def pair(e: float | None, g: float | None, fmt: str) -> str:
        return "-" if e is None or g is None else f"{e:{fmt}} / {g:{fmt}}"

    def figure(d: dict[str, Any], *path: str) -> float | None:
        for key in path:
            d = d.get(key, {}) if isinstance(d, dict) else {}
        return d if isinstance(d, float | int) else None

    for task, t in result["tasks"].items():
        essa_by_seed = {r.get("seed"): r for r in t["essa"]}
        for g in grpo_runs_of(t):
            e = essa_by_seed[g["seed"]]
            de, dg = e["summary"].get("drift") or {}, g["summary"].get("drift") or {}
            if "kl_base" not in de or "kl_base" not in dg:
                continue
            k = de.get("samples", {}).get("k", "K")
            lines.append(
                f"| {task} | {g['seed']} | {e['essa_vs_sft']['gain']:+.3f} / "
                f"{g['grpo_vs_sft']['gain']:+.3f} | {de['kl_base_sft']:.3f} | "
                f"{pair(de['kl_base'], dg['kl_base'], '.3f')} | "
                f"{pair(de.get('kl_sft'), dg.get('kl_sft'), '.3f')} | "
                f"{pair(figure(de, 'update', 'final', 'mean'), figure(dg, 'update', 'final', 'mean'), '.4f')} | "
                f"{pair(figure(de, 'samples', f'pass@{k}'), figure(dg, 'samples', f'pass@{k}'), '.3f')} | "
                f"{retention_change([e])}; {retention_change([g])} |"
            )  # fmt: skip
    return "\n".join(lines) if len(lines) > 2 else ""


def table(result: dict[str, Any]) -> str:
    lines = [
        "| task | prompt / answer tokens | base | SFT | scale baseline | ESSA "
        "| ESSA - SFT (paired SE) | gain / SE "
        "| per seed z | full credit: SFT -> ESSA (paired SE) | run s (median) "
        "| generations made (planned) | search s actual / planned (share of budgeted phases / of run) "
        "| GRPO at equal wall-clock | peak RSS ESSA / GRPO "
        "| off-task KL(base‖tuned) ESSA / GRPO (ratio ± SE) "
        "| retention change from base / SFT (runs x items) ESSA; GRPO |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for task, t in result["tasks"].items():
        acc = {k: mean_accuracy(t["essa"], k) for k in ("sft", "scale", "final")}
        scale = "-" if acc["scale"] is None else f"{acc['scale']:.3f}"
        wall = statistics.median(r["summary"]["wall_seconds"] for r in t["essa"])
        p = t["essa_vs_sft"]
        z = ", ".join(z_cell(v) for v in p["per_seed_z"])
        grpo, mem = grpo_cells(t)
        kl, kept = drift_cells(t), retention_cell(t)
        strict = "-"
        if "essa_vs_sft_full_credit" in t:
            f = t["essa_vs_sft_full_credit"]
            sft_full = statistics.mean(r["full_credit"]["sft"] for r in t["essa"])
            essa_full = statistics.mean(r["full_credit"]["final"] for r in t["essa"])
            strict = f"{sft_full:.3f} -> {essa_full:.3f} ({f['gain']:+.3f}, {f['se']:.3f})"
        lines.append(
            f"| {task} | {lengths_cell(t['essa'])} | {t['base_accuracy']:.3f} | {acc['sft']:.3f} | {scale} | "
            f"{acc['final']:.3f} | {p['gain']:+.3f} ({p['se']:.3f}) | {z_cell(p['z'])} | {z} | "
            f"{strict} | {wall:.0f} | {' | '.join(plan_cells(t['essa']))} | {grpo} | {mem} | "
            f"{kl} | {kept} |"
        )
    return "\n".join(lines)


def z_cell(z: float) -> str:
    """A gain over its SE, to one place; "-" where the SE is 0 (the point scored as its start on
    every item).

    >>> z_cell(2.54), z_cell(float("nan"))
    ('2.5', '-')
    """
    return "-" if math.isnan(z) else f"{z:.1f}"


# The README's columns of :func:`table`: lengths, SFT and ESSA, the gain, the plan, GRPO.
SHORT_COLUMNS = (
    "task", "prompt / answer tokens", "SFT", "ESSA", "ESSA - SFT (paired SE)", "per seed z",
    "generations made (planned)", "search s actual / planned (share of budgeted phases / of run)",
    "GRPO at equal wall-clock", "peak RSS ESSA / GRPO",
)  # fmt: skip


def short_table(result: dict[str, Any]) -> str:
    """:func:`table` cut to :data:`SHORT_COLUMNS`, for the README (no cell holds a "|")."""
    rows = [line.strip("|").split("|") for line in table(result).splitlines()]
    keep = [i for i, name in enumerate(rows[0]) if name.strip() in SHORT_COLUMNS]
    return "\n".join("|" + "|".join(row[i] for i in keep) + "|" for row in rows)


def check_cell(scale_baseline: dict[str, Any] | None) -> str:
    """The tie-breaker's check at the scaled start: kept (it raised the training reward), kept
    on a tie of the two rewards, or dropped; "-" for a run without it.

    >>> check_cell({"reference_check": {"agrees": True, "reward_with": 0.2, "reward_without": 0.2}})
    'kept (tie)'
    """
    check = (scale_baseline or {}).get("reference_check")
    if not check:
        return "-"
    if not check["agrees"]:
        return "dropped"
    return "kept (tie)" if check["reward_with"] == check["reward_without"] else "kept"


def stop_kind(summary: dict[str, Any], ceiling: int | None = None) -> str:
    """Why a run's search ended, in a word or two: the pre-flight's floor or ceiling, the
    patience or no-signal stop after a check (essa.es.watch), else the generation cap
    (``ceiling``: the run's run.generations; without it, the plan's count) or the budget.

    >>> stop_kind({"stop_reason": "stopping after generation 12: validation has not improved "
    ...            "for 2 checks (best 0.310, run.patience 2)", "generations": 12})
    'patience (12)'
    >>> stop_kind({"stop_reason": None, "generations": 40, "plan": {"generations": 40}})
    'cap (40)'
    >>> stop_kind({"stop_reason": None, "generations": 39, "plan": {"generations": 24}}, 40)
    'budget (39)'
    >>> stop_kind({"stop_reason": "stopping: run.max_wall_seconds=1140 would be passed by the "
    ...            "next generation", "generations": 31}, 40)
    'budget (31)'
    """
    reason, made = summary.get("stop_reason") or "", summary["generations"]
    if reason.startswith("start at the ceiling"):
        return "ceiling (pre-flight)"
    if reason.startswith("no signal: the start scores"):
        return "floor (pre-flight)"
    if "validation has not improved" in reason:
        return f"patience ({made})"
    if "no signal" in reason:
        return f"no signal ({made})"
    if "run.max_wall_seconds" in reason:
        return f"budget ({made})"
    if reason:
        return reason.split(":")[0]
    cap = ceiling if ceiling is not None else (summary.get("plan") or {}).get("generations")
    return f"cap ({made})" if cap is None or made >= cap else f"budget ({made})"


def watch_cells(record: dict[str, Any]) -> list[str]:
    """A run's own reading of its signal (docs/signal.md): the median signal, the exported
    point, why it stopped and the share of its budget it used; "-" for a record from before.

    >>> s = {"exported": {"point": "SFT adapter"}, "stop_reason": "no signal: the start scores "
    ...      "0.000 on 64 validation items", "generations": 0, "wall_seconds": 285.0,
    ...      "plan": {"budget": 1140.0}}
    >>> watch_cells({"summary": s, "signal_median": 0.02})
    ['0.02', 'SFT adapter', 'floor (pre-flight)', '25%']
    """
    s = record["summary"]
    signal = record.get("signal_median")
    exported = (s.get("exported") or {}).get("point", "-")
    stop = "-" if "exported" not in s else stop_kind(s, record.get("ceiling"))
    budget = (s.get("plan") or {}).get("budget")
    used = f"{s['wall_seconds'] / budget:.0%}" if budget else "-"
    return ["-" if signal is None else f"{signal:.2f}", exported, stop, used]


def seeds_table(result: dict[str, Any]) -> str:
    """One row per task and seed: the SFT adapter, the scaled start the search began from, the
    tie-breaker's check, the final adapter and its paired gains, the plan's prompts per
    generation, generations, run seconds and peak RSS."""
    lines = [
        "| task | seed | SFT | start | check | ESSA | ESSA - SFT (paired SE) | ESSA - start (SE) "
        "| margin prompts (median) | signal (median) | exported | stop | budget used "
        "| generations | run s | peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for task, t in result["tasks"].items():
        for r in t["essa"]:
            s, acc = r["summary"], r["accuracy"]
            scale = s.get("scale_baseline") or {}
            vs_start, margin = r.get("essa_vs_scale"), r.get("margin_prompts_median")
            p = r["essa_vs_sft"]
            cells = [
                task, r["seed"], f"{acc['sft']:.3f}",
                f"x{scale['factor']:g}: {acc['scale']:.3f}" if "scale" in acc else "-",
                check_cell(scale), f"{acc['final']:.3f}", f"{p['gain']:+.3f} ({p['se']:.3f})",
                f"{vs_start['gain']:+.3f} ({vs_start['se']:.3f})" if vs_start else "-",
                "-" if margin is None else f"{margin:.1f} of {s.get('plan', {}).get('prompts')}",
                *watch_cells(r), s["generations"], f"{s['wall_seconds']:.0f}",
                f"{s['peak_rss_mb']:.0f} MB" if s.get("peak_rss_mb") else "-",
            ]  # fmt: skip
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def before_gains(name: str | None) -> dict[str, str]:
    """Each task's ESSA - SFT (paired SE) in an earlier result ``bench/results/NAME.json``, the
    gain the signal table sets beside today's; {} without one."""
    if not name:
        return {}
    earlier = json.loads((RESULTS / f"{name}.json").read_text())
    tasks = earlier.get("result", earlier)["tasks"]
    return {t: f"{v['essa_vs_sft']['gain']:+.3f} ({v['essa_vs_sft']['se']:.3f})"
            for t, v in tasks.items()}  # fmt: skip


def grpo_gain_cell(t: dict[str, Any]) -> str:
    """GRPO's held-out gain over its SFT adapter pooled over its seeds, with its paired SE and
    the seeds; "-" without GRPO runs.

    >>> grpo_gain_cell({"grpo_runs": [{"seed": 0, "grpo_vs_sft": {"gain": 0.05, "se": 0.02}}]})
    '+0.050 (0.020, seed 0)'
    """
    runs = grpo_runs_of(t)
    if not runs:
        return "-"
    p = pooled(runs, "grpo_vs_sft")
    seeds = ", ".join(str(r["seed"]) for r in runs)
    return f"{p['gain']:+.3f} ({p['se']:.3f}, seed{'s' if len(runs) > 1 else ''} {seeds})"


def signal_table(result: dict[str, Any], before: dict[str, str]) -> str:
    """One row per task: how the runs read their own signal (docs/signal.md), over seeds:
    why each stopped, generations made, the share of the budget used (median), the signal
    (median of the runs' medians), the exported points, and ESSA - SFT on the test split
    pooled over seeds beside ``before`` (the same task in an earlier result) and GRPO's gain
    over the same SFT adapters at equal wall-clock (on the GRPO seeds)."""
    lines = [
        "| task | SFT | ESSA | ESSA - SFT (paired SE) | before | GRPO - SFT (paired SE, seeds) "
        "| stop (per seed) | generations | budget used (median) | signal (median) "
        "| exported (per seed) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for task, t in result["tasks"].items():
        cells = [watch_cells(r) for r in t["essa"]]  # signal, exported, stop, used
        signals = [r["signal_median"] for r in t["essa"] if r.get("signal_median") is not None]
        used = [r["summary"]["wall_seconds"] / r["summary"]["plan"]["budget"]
                for r in t["essa"] if (r["summary"].get("plan") or {}).get("budget")]  # fmt: skip
        p = t["essa_vs_sft"]
        lines.append(
            f"| {task} | {mean_accuracy(t['essa'], 'sft'):.3f} | "
            f"{mean_accuracy(t['essa'], 'final'):.3f} | {p['gain']:+.3f} ({p['se']:.3f}) | "
            f"{before.get(task, '-')} | {grpo_gain_cell(t)} | {'; '.join(c[2] for c in cells)} | "
            f"{', '.join(str(r['summary']['generations']) for r in t['essa'])} | "
            f"{f'{statistics.median(used):.0%}' if used else '-'} | "
            f"{f'{statistics.median(signals):.2f}' if signals else '-'} | "
            f"{'; '.join(c[1] for c in cells)} |"
        )
    return "\n".join(lines)


def lengths_cell(runs: list[dict[str, Any]]) -> str:
    """The task's mean prompt and reference-answer lengths in the model's tokens, as the plan
    measured them on the first seed's data; "-" for runs made before the plan existed or with
    the plan off (``run.plan: false`` records ``"plan": null``).

    >>> lengths_cell([{"summary": {"plan": {"lengths": {"prompt_mean": 62.7, "reference_mean": 9.2}}}}])
    '63 / 9.2'
    >>> lengths_cell([{"summary": {"plan": None}}])
    '-'
    """
    for run in runs:
        lengths = (run["summary"].get("plan") or {}).get("lengths")
        if lengths:
            return f"{lengths['prompt_mean']:.0f} / {lengths['reference_mean']:.1f}"
    return "-"


def plan_cells(runs: list[dict[str, Any]]) -> tuple[str, str]:
    """The plan against the run: generations made (planned) per seed, and the search's seconds,
    actual / planned, with its share of the phases the budget sizes (model load to the last
    generation) and of the whole run (with the final evaluation and the drift report); means
    over seeds; "-" for runs made before the plan existed.

    >>> phases = {"generations": {"actual": 790.0, "planned": 800.0}, "SFT": {"actual": 210.0}}
    >>> run = {"summary": {"generations": 22, "wall_seconds": 1300.0, "plan": {"generations": 25},
    ...        "phases": phases}}
    >>> plan_cells([run, run])
    ('22 (25), 22 (25)', '790 / 800 (79% / 61%)')
    """
    planned = [r["summary"] for r in runs if r["summary"].get("plan")]
    if not planned:
        return "-", "-"
    made = ", ".join(f"{s['generations']} ({s['plan']['generations']})" for s in planned)
    search = [s["phases"]["generations"]["actual"] for s in planned]
    budgeted = [sum(p["actual"] for p in s["phases"].values()) for s in planned]
    planned_search = statistics.mean(s["phases"]["generations"]["planned"] for s in planned)
    of_phases = statistics.mean(a / b for a, b in zip(search, budgeted, strict=True))
    of_run = statistics.mean(a / s["wall_seconds"] for a, s in zip(search, planned, strict=True))
    return made, (
        f"{statistics.mean(search):.0f} / {planned_search:.0f} ({of_phases:.0%} / {of_run:.0%})"
    )


def replay_args(record: dict[str, Any], config: Path, run_dir: Path) -> list[str]:
    """The archived ``essa train`` command again, on ``config`` (its recorded config text) into
    ``run_dir``, with what made it depend on the clock pinned: the run plan off, and no
    wall-clock budget, its recorded generation count run instead (all of them when the budget
    never bound), so the replay makes the very generations the record made."""
    args = list(record["command"]["args"])
    args[1] = str(config)
    args[args.index("--run-dir") + 1] = str(run_dir)
    summary = json.loads(record["files"]["summary.json"])
    pins = [
        "run.plan=false",
        "run.max_wall_seconds=null",
        f"run.generations={summary['generations']}",
    ]
    return [*args, *sets(pins)]


def pass_scores(text: str) -> dict[tuple[str, int], list[float]]:
    """heldout_scores.jsonl's per-item scores by (pass, generation)."""
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return {(r["pass"], r["generation"]): r["scores"] for r in rows}


def verify(task: str, name: str, args: argparse.Namespace) -> bool:
    """Run the archived command ``name`` of ``task`` again and compare every held-out pass's
    per-item scores with its record; True when all are the same."""
    record = read_archive(ARCHIVE / f"{task}.jsonl.xz").get(name)
    if record is None or record["command"]["args"][0] != "train":
        raise SystemExit(f"--verify {name}: no archived essa train command of that name for {task}")
    root = Path(args.root) / task / "verify"
    root.mkdir(parents=True, exist_ok=True)
    config = root / f"{name}.yaml"
    config.write_text(record["command"]["config"])
    run_dir, log = root / name, root / f"{name}.log"
    command = replay_args(record, config, run_dir)
    print(f"[real_model] {task} {name}: essa {' '.join(command)}", flush=True)
    seconds = essa(command, log, args.threads)
    want = pass_scores(record["files"]["heldout_scores.jsonl"])
    got = pass_scores((run_dir / "heldout_scores.jsonl").read_text())
    same = want == got
    for key in sorted(set(want) | set(got), key=lambda k: k[1]):
        a, b = want.get(key), got.get(key)
        diff = (
            "missing" if a is None or b is None else sum(x != y for x, y in zip(a, b, strict=True))
        )
        mean = "" if b is None else f" mean {statistics.mean(b):.6f}"
        print(f"[real_model] {task} {name} {key[0]} (generation {key[1]}): "
              f"{'same' if a == b else f'differs ({diff} items)'}{mean}", flush=True)  # fmt: skip
    print(f"[real_model] {task} {name}: {'reproduced' if same else 'NOT reproduced'} in "
          f"{seconds:.0f} s (recorded {record['command']['seconds']:.0f} s)", flush=True)  # fmt: skip
    return same


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; a ``--grpo-seeds`` seed that is not in ``--seeds`` is a usage error (GRPO
    starts from that seed's ESSA run, so it would silently not run)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(ALL_TASKS),
                        help="default: the three tasks of the README table; also "
                        + ", ".join([*UNTUNED, *EDGES]))  # fmt: skip
    parser.add_argument("--no-grpo", dest="grpo", action="store_false")
    parser.add_argument(
        "--grpo-tasks",
        nargs="+",
        choices=list(ALL_TASKS),
        default=None,
        help="run GRPO beside ESSA on these tasks only (default: every task)",
    )
    parser.add_argument(
        "--grpo-seeds",
        type=int,
        nargs="+",
        default=None,
        help="run GRPO on these of --seeds (default: the first)",
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="keep finished runs under --root (their summary.json and recorded "
        "seconds) and run only the missing ones, e.g. more seeds later",
    )
    parser.add_argument("--root", default="runs/bench-real-model")
    parser.add_argument(
        "--no-restore",
        dest="restore",
        action="store_false",
        help="with --reuse, run what --root lacks instead of restoring it from the archive",
    )
    parser.add_argument(
        "--verify",
        metavar="NAME",
        help="run the archived command NAME (e.g. essa-seed0) of each of --tasks again and "
        "check that every held-out pass reproduces its recorded per-item scores",
    )
    parser.add_argument(
        "--before",
        metavar="NAME",
        help="an earlier result (bench/results/NAME.json) whose ESSA - SFT per task the signal "
        "table (OUT_signal.md) sets beside this run's",
    )
    parser.add_argument(
        "--out",
        default="real_model",
        help="write bench/results/OUT.json and OUT.md (a partial run keeps the main table)",
    )
    args = parser.parse_args(argv)
    missing = sorted(set(args.grpo_seeds or ()) - set(args.seeds))
    if missing:
        parser.error(
            f"--grpo-seeds {' '.join(map(str, missing))}: not in --seeds "
            f"{' '.join(map(str, args.seeds))} (GRPO runs on an ESSA seed's own SFT adapter)"
        )
    return args


def main() -> None:
    args = parse_args()
    common.RESTORE = args.restore
    if args.verify:
        results = [verify(task, args.verify, args) for task in args.tasks]
        raise SystemExit(0 if all(results) else 1)
    result: dict[str, Any] = {"config": str(CONFIG), "overrides": args.overrides, "tasks": {}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    for task in args.tasks:
        result["tasks"][task] = run_task(task, args)
    command = "python -m bench.studies.real_model " + " ".join(sys.argv[1:])
    write_result(args.out, result, command.strip())
    (RESULTS / f"{args.out}.md").write_text(table(result) + "\n")
    (RESULTS / f"{args.out}_short.md").write_text(short_table(result) + "\n")
    (RESULTS / f"{args.out}_seeds.md").write_text(seeds_table(result) + "\n")
    (RESULTS / f"{args.out}_signal.md").write_text(
        signal_table(result, before_gains(args.before)) + "\n"
    )
    drift = drift_table(result)
    if drift:
        (RESULTS / f"{args.out}_drift.md").write_text(drift + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
