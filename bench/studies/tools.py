"""Tool-integrated reasoning on a real model: text-only ESSA, tool-integrated ESSA and GRPO.

    python -m bench.studies.tools [--seeds 0 1 2] [--tasks products count_bits ...]
                          [--budget 1140] [--no-grpo] [--set k=v] [--reuse]

Per reasoning-gym task (where exact computation helps a 135M model) and seed, from
``configs/smollm2.yaml`` with only the task swapped in, each command in a fresh process:

* two SFT adapters, ``essa sft`` for the config's ``sft.steps`` (48) each: one on the plain
  answers (template chat), one on code-call targets (template ``python_tool``,
  essa.data.tool_sft: the code that computes the answer, its output, "The answer is N.");
* **text ESSA**: ``essa train`` from the text SFT adapter, text-only rollouts;
* **tool ESSA**: ``essa train`` from the tool SFT adapter with ``tools.python.max_tool_calls:
  2``: the population's rollouts and every held-out pass may run two Python blocks (the SFT
  targets hold one; a second computes on its output or retries an error);
* **tool GRPO**: ``algorithm: grpo`` from the same tool SFT adapter, with tools.

Both SFT adapters train for the same steps outside the budget, as the ESSA paper reports its
search: inside a budget, the run plan caps SFT at 15% of it, and the longer code-call targets
then get fewer steps than the plain answers (18 of 48 on products at 1140 s, a held-out score of
0.032 where a 48-step adapter answered 32 of 32). An adapter trains only when an arm that starts
from it has to run: ``--reuse`` restores an archived arm, which needs no weights. Every arm then
gets ``--budget`` seconds (``run.max_wall_seconds``, 1140 by default: the SFT adapter's held-out
pass, the scaled start and the search; the final evaluation comes on top). Reported per arm:
held-out accuracy of its SFT start and of its final adapter on the same items (paired SE),
generations (steps), tool calls per item, the tool error rate and the share of items whose final
answer a tool run printed (the final held-out pass's ``tools`` in summary.json).

Writes bench/results/tools.json, tools.md (the table in docs/tools.md and docs/results.md) and
tools_summary.md (README's table).
Everything the runs print goes to <root>/<task>/*.log.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.common import RESULTS, write_result
from bench.studies.common import (
    essa_command,
    essa_seed,
    grpo_command,
    grpo_seed,
    must_run,
    over_seeds,
    paired,
    passes,
    sft_adapter,
    sft_path,
    task_config,
)

TASKS: dict[str, dict[str, Any]] = {
    "products": {"min_digits": 2, "max_digits": 2},  # two 2-digit factors
    "count_bits": {"min_n": 1, "max_n": 1_000_000},  # 1 bits of a number up to 10^6
    # Word problems: the quantities are in the text, the code must be written from it. The
    # legs of 3-10 kinds of animal (the model must know each kind's legs), and dates written
    # out (weekdays, offsets, counts of a weekday between two dates, leap years).
    "leg_counting": {},
    "calendar_arithmetic": {},
    # The words to sort are in the text: the code must copy each one exactly (case, accents).
    "word_sorting": {},
    # A number and two bases are in the text: the code copies them into a fixed digit loop
    # (the text SFT adapter scores 0.004: the model cannot convert in its head).
    "base_conversion": {},
}
# Two calls a rollout: a second block can compute on the first one's output or retry an error.
TOOLS = ["tools.python.max_tool_calls=2", "data.template=python_tool"]
ARMS = ("text ESSA", "tool ESSA", "tool GRPO")


def step_seconds(run_dir: Path) -> float | None:
    """Median wall-clock seconds of a generation (a GRPO step) in the run's metrics.jsonl."""
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    seconds = [r["seconds"] for r in rows if "seconds" in r and r.get("event") != "baseline"]
    return statistics.median(seconds) if seconds else None


def arm_record(arm: str, run: dict[str, Any]) -> dict[str, Any]:
    """What the table reads of one run: accuracies, the paired gain over SFT, tool use, cost."""
    summary = run["summary"]
    gain = run.get("essa_vs_sft") or run.get("grpo_vs_sft")
    return {
        "arm": arm,
        "seed": run["seed"],
        "sft": run["accuracy"]["sft"],
        "final": run["accuracy"]["final"],
        "vs_sft": gain,
        "steps": summary["generations"],
        "wall_seconds": summary["wall_seconds"],
        "step_seconds": step_seconds(Path(run["run_dir"])),
        "peak_rss_mb": summary.get("peak_rss_mb"),
        "tools": summary.get("tools"),
    }


def arm_adapter(config: Path, seed: int, root: Path, name: str, sets_: list[str],
                commands: list[tuple[list[str], Path, list[Path]]], trained: set[str],
                args: argparse.Namespace) -> None:  # fmt: skip
    """Train ``name``'s SFT adapter (once: ``trained``) when one of the arm ``commands``
    starting from it has to run: an arm the archive restores needs no weights, and SFT costs
    minutes."""
    if name in trained or not any(must_run(*command, args.reuse) for command in commands):
        return
    print(f"[tools] {root.name} seed {seed}: {name} SFT adapter ...", flush=True)
    sft_adapter(config, seed, root, name, sets_, args.threads, args.reuse)
    trained.add(name)


def run_task(task: str, args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.root) / task
    config = task_config(task, TASKS[task], root)
    # No extra held-out pass for the scale baseline inside the budget (bench.studies.real_model asks
    # for one); the search still starts from the plan's bounded scaled start.
    budget = [f"run.max_wall_seconds={args.budget}", "evaluation.use_scale_baseline=false",
              *args.overrides]  # fmt: skip
    arms: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for seed in args.seeds:
        text_sets = [f"adapter.path={sft_path(root, 'text', seed)}", *budget]
        tool_sets = [*TOOLS, f"adapter.path={sft_path(root, 'tool', seed)}", *budget]
        trained: set[str] = set()
        print(f"[tools] {task} seed {seed}: text ESSA ...", flush=True)
        text_commands = [essa_command(config, seed, root, text_sets, "text")]
        arm_adapter(config, seed, root, "text", args.overrides, text_commands, trained, args)
        text = essa_seed(config, seed, root, text_sets, args.threads, args.reuse, "text")
        arms["text ESSA"].append(arm_record("text ESSA", text))
        print(f"[tools] {task} seed {seed}: tool ESSA ...", flush=True)
        tool_commands = [essa_command(config, seed, root, tool_sets, "tool")]
        arm_adapter(config, seed, root, "tool", [*TOOLS, *args.overrides], tool_commands, trained,
                    args)  # fmt: skip
        tool = essa_seed(config, seed, root, tool_sets, args.threads, args.reuse, "tool")
        arms["tool ESSA"].append(arm_record("tool ESSA", tool))
        if args.grpo:
            print(f"[tools] {task} seed {seed}: tool GRPO ...", flush=True)
            # grpo_seed gives GRPO the ESSA run's wall-clock; the same budget is fairer here.
            tool["summary"] = {**tool["summary"], "wall_seconds": args.budget}
            grpo_sets = [*TOOLS, *budget]
            arm_adapter(config, seed, root, "tool", [*TOOLS, *args.overrides],
                        [grpo_command(config, tool, root, grpo_sets)], trained, args)  # fmt: skip
            grpo = grpo_seed(config, tool, root, grpo_sets, args.threads, args.reuse)
            arms["tool GRPO"].append(arm_record("tool GRPO", grpo))
        record = arms["tool ESSA"][-1]
        print(f"[tools] {task} seed {seed}: text {arms['text ESSA'][-1]['final']:.3f}, tool "
              f"ESSA {record['final']:.3f} (SFT {record['sft']:.3f})", flush=True)  # fmt: skip
    return {
        "params": TASKS[task],
        "arms": {arm: runs for arm, runs in arms.items() if runs},
        "pooled": {
            arm: over_seeds([r["vs_sft"] for r in runs]) for arm, runs in arms.items() if runs
        },
        "tool_vs_text": [paired_finals(root, "tool", "text", seed) for seed in args.seeds],
    }


def paired_finals(root: Path, a: str, b: str, seed: int) -> dict[str, float]:
    """Final held-out scores of run ``a`` against run ``b`` on the same items (paired)."""
    return paired(
        passes(root / f"{a}-seed{seed}")["final"], passes(root / f"{b}-seed{seed}")["final"]
    )


def table(result: dict[str, Any]) -> str:
    rows = [
        "| task | arm | seeds | SFT | final | final - SFT (SE) | generations / steps | "
        "tool calls / item | items with 0 / 1 / 2+ calls | tool errors | void turns | "
        "answer printed by a tool | s / generation | peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for task, t in result["tasks"].items():
        for arm, runs in t["arms"].items():
            p = t["pooled"][arm]
            tools = [r["tools"] for r in runs if r["tools"]]
            rows.append(
                f"| {task} | {arm} | {len(runs)} | {statistics.mean(r['sft'] for r in runs):.3f} | "
                f"{statistics.mean(r['final'] for r in runs):.3f} | {p['gain']:+.3f} ({p['se']:.3f}) | "
                f"{statistics.mean(r['steps'] for r in runs):.0f} | {tool_cells(tools)} | "
                f"{mean_cell(tools, 'tool_output_used')} | {cost(runs)}"
            )
    return "\n".join(rows)


def mean_cell(records: list[dict[str, Any]], key: str) -> str:
    """The mean of ``key`` over the records that hold it (older records lack some), or "-"."""
    values = [x[key] for x in records if key in x]
    return f"{statistics.mean(values):.2f}" if values else "-"


def tool_cells(records: list[dict[str, Any]]) -> str:
    """Tool use as table cells: calls per item | 0 / 1 / 2+ call shares | errors | void turns."""
    shares = " / ".join(
        mean_cell(records, k)
        for k in ("tool_rows_0_calls", "tool_rows_1_call", "tool_rows_2plus_calls")
    )
    return (
        f"{mean_cell(records, 'tool_calls_per_row')} | {shares} | "
        f"{mean_cell(records, 'tool_error_rate')} | {mean_cell(records, 'tool_void_rows')}"
    )


def summary_table(result: dict[str, Any]) -> str:
    """README's table: per task and arm, the mean held-out score of the SFT start and of the
    final adapter over seeds, with the pooled gain and its SE."""
    rows = ["| task | " + " | ".join(ARMS) + " |", "|---|" + "---|" * len(ARMS)]
    for task, t in result["tasks"].items():
        cells = []
        for arm in ARMS:
            runs, p = t["arms"].get(arm), t["pooled"].get(arm)
            cells.append(
                f"{statistics.mean(r['sft'] for r in runs):.3f} -> "
                f"{statistics.mean(r['final'] for r in runs):.3f} ({p['gain']:+.3f}, SE "
                f"{p['se']:.3f})" if runs else "-"
            )  # fmt: skip
        rows.append(f"| {task} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def cost(runs: list[dict[str, Any]]) -> str:
    """The cost cells of a table row: the median seconds a generation (a GRPO step) took,
    averaged over seeds, and the largest peak RSS of any seed."""
    seconds = [r["step_seconds"] for r in runs if r.get("step_seconds")]
    rss = [r["peak_rss_mb"] for r in runs if r.get("peak_rss_mb")]
    return (f"{statistics.mean(seconds):.0f} | " if seconds else "- | ") + (
        f"{max(rss) / 1000:.1f} GB |" if rss else "- |"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--budget", type=int, default=1140, help="run.max_wall_seconds per arm")
    parser.add_argument("--no-grpo", dest="grpo", action="store_false")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reuse", action="store_true", help="keep finished runs under --root")
    parser.add_argument("--root", default="runs/bench-tools")
    parser.add_argument("--out", default="tools", help="write bench/results/OUT.json and OUT.md")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    result: dict[str, Any] = {"budget": args.budget, "overrides": args.overrides, "tasks": {}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    for task in args.tasks:
        result["tasks"][task] = run_task(task, args)
    write_result(
        args.out, result, ("python -m bench.studies.tools " + " ".join(sys.argv[1:])).strip()
    )
    (RESULTS / f"{args.out}.md").write_text(table(result) + "\n")
    (RESULTS / f"{args.out}_summary.md").write_text(summary_table(result) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
