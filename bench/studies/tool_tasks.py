"""Which tasks leave a tool something to teach: the code-call SFT adapter's held-out score.

    python -m bench.studies.tool_tasks [--tasks word_sorting base_conversion ...] [--seeds 0]
                               [--items 200] [--root runs/bench-tools] [--reuse]

A tool study can tell its recipes apart only on a task whose code-call SFT adapter is neither at
the floor nor at the ceiling (products and count_bits: 99-100% right, nothing to rank). Per task
of bench.studies.tools' TASKS and seed, each command in a fresh process from
``configs/smollm2.yaml`` with only the task swapped in:

* ``essa sft`` on code-call targets (template ``python_tool``, essa.data.tool_sft), the
  config's ``sft.steps``: the adapter bench.studies.tools' tool arms start from (the same
  directory under the same ``--root``, so either study reuses the other's);
* ``essa eval`` of that adapter with the tool on, greedy, on the first ``--items`` test items
  (no drift report).

Reported per task: the held-out score (mean over seeds, and per seed), the share of answers
with 0 / 1 / 2+ calls, tool errors, void turns, and whether it lies in [0.2, 0.7], the range
where the study's issue asks for tasks. Writes bench/results/OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.common import RESULTS, write_result
from bench.studies.common import sets, sft_adapter, sft_path, task_config, timed
from bench.studies.tools import TASKS, TOOLS, tool_cells

RANGE = (0.2, 0.7)  # a start with room above it and signal to rank
# The probe scores the adapter only: no off-task KL, no retention or pass@K pass.
EVAL_SETS = ["evaluation.drift.prompts=0", "evaluation.drift.items=0"]


def probe(task: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """The code-call SFT adapter of ``task`` and ``seed`` and its held-out pass with tools."""
    root = Path(args.root) / task
    config = task_config(task, TASKS[task], root)
    print(f"[tool_tasks] {task} seed {seed}: code-call SFT adapter ...", flush=True)
    sft_adapter(config, seed, root, "tool", [*TOOLS, *args.overrides], args.threads, args.reuse)
    out = root / f"sft-tool-seed{seed}-eval.json"
    cli = ["eval", str(config), "--adapter", str(sft_path(root, "tool", seed)),
           "--output", str(out), "--set", f"run.seed={seed}",
           *sets([*TOOLS, f"data.test_size={args.items}", *EVAL_SETS, *args.overrides])]  # fmt: skip
    print(f"[tool_tasks] {task} seed {seed}: held-out pass with tools ...", flush=True)
    seconds = timed(cli, out, root / f"sft-tool-seed{seed}-eval.log", args.threads, args.reuse)
    result = json.loads(out.read_text())
    print(f"[tool_tasks] {task} seed {seed}: {result['mean_score']:.3f} on {result['n']} items",
          flush=True)  # fmt: skip
    keep = ("mean_score", "pass@1", "n", *(k for k in result if k.startswith("tool_")))
    return {"seed": seed, "seconds": seconds, **{k: result[k] for k in keep if k in result}}


def in_range(score: float) -> str:
    """Whether a start leaves room to climb and signal to rank.

    >>> in_range(0.224), in_range(0.99), in_range(0.004)
    ('yes', 'no (ceiling)', 'no (floor)')
    """
    if score < RANGE[0]:
        return "no (floor)"
    return "no (ceiling)" if score > RANGE[1] else "yes"


def table(result: dict[str, Any]) -> str:
    rows = [
        "| task | seeds | code-call SFT held-out (per seed) | items | tool calls / item "
        "| items with 0 / 1 / 2+ calls | tool errors | void turns | in [0.2, 0.7] |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for task, probes in result["tasks"].items():
        score = statistics.mean(p["mean_score"] for p in probes)
        per_seed = ", ".join(f"{p['mean_score']:.3f}" for p in probes)
        rows.append(
            f"| {task} | {len(probes)} | {score:.3f} ({per_seed}) | {probes[0]['n']} | "
            f"{tool_cells(probes)} | {in_range(score)} |"
        )
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--items", type=int, default=200, help="held-out items scored")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reuse", action="store_true", help="keep finished commands under --root")
    parser.add_argument("--root", default="runs/bench-tools")
    parser.add_argument("--out", default="tool_tasks", help="bench/results/OUT.json and OUT.md")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    result: dict[str, Any] = {"items": args.items, "overrides": args.overrides, "tasks": {}}
    for task in args.tasks:
        result["tasks"][task] = [probe(task, seed, args) for seed in args.seeds]
    command = ("python -m bench.studies.tool_tasks " + " ".join(sys.argv[1:])).strip()
    write_result(args.out, result, command)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.md").write_text(table(result) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
