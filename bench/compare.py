"""ESSA and GRPO side by side on the demo task: one table and one plot.

    python -m bench.compare [--threads 2] [--grpo-config configs/grpo_demo.yaml] [--set k=v ...]

Runs `essa train configs/demo.yaml` (ESSA) and then GRPO from the same SFT start (by default
`--set algorithm=grpo` on the same config: 8 prompts x G=8 per step; `--grpo-config
configs/grpo_demo.yaml` for the equal generated-token budget, about 25 minutes on 2 cores),
one after the other in fresh processes with the same thread count, then writes
bench/results/compare.md, compare.png and compare.json (`essa compare` on the two run
directories, plus each process's peak resident memory measured from outside).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from essa.compare import compare

RESULTS = Path("bench/results")


def train(config: Path, run_dir: Path, overrides: list[str], threads: int) -> dict[str, Any]:
    """One `essa train` in a fresh process; returns its wall time and peak RSS."""
    cmd = [sys.executable, "-m", "essa.cli", "train", str(config), "--overwrite",
           "--run-dir", str(run_dir), "--set", "run.show_progress=false",
           "--set", f"model.num_threads={threads}"]  # fmt: skip
    for item in overrides:
        cmd += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    with open(run_dir.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, not the max of all
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed; see {run_dir.with_suffix('.log')}")
    return {
        "command": " ".join(cmd[2:]),
        "command_wall_seconds": round(time.perf_counter() - start, 1),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--essa-config", type=Path, default=Path("configs/demo.yaml"))
    parser.add_argument("--grpo-config", type=Path, default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--runs", type=Path, default=Path("runs/bench-compare"))
    parser.add_argument("--target", type=float, default=0.9)
    args = parser.parse_args()
    args.runs.mkdir(parents=True, exist_ok=True)
    essa_dir, grpo_dir = args.runs / "essa", args.runs / "grpo"
    processes = {"essa": train(args.essa_config, essa_dir, args.overrides, args.threads)}
    grpo_config = args.grpo_config or args.essa_config
    grpo_overrides = ([] if args.grpo_config else ["algorithm=grpo"]) + args.overrides
    processes["grpo"] = train(grpo_config, grpo_dir, grpo_overrides, args.threads)
    text = compare([essa_dir, grpo_dir], RESULTS, args.target)
    ratio = processes["essa"]["peak_rss_mb"] / processes["grpo"]["peak_rss_mb"]
    command = (
        "python -m bench.compare"
        + "".join(
            f" --{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if k in ("threads", "grpo_config") and v is not None
        )
        + "".join(f" --set {o}" for o in args.overrides)
    )
    (RESULTS / "compare.json").write_text(
        json.dumps({"command": command, "processes": processes, "table": text}, indent=2) + "\n"
    )
    print(text)
    print(f"\npeak RSS (whole process, CPU): ESSA / GRPO = {ratio:.2f}")
    print(f"(reproduce: {command})")


if __name__ == "__main__":
    main()
