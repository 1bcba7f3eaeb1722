"""ESSA on 1 rank vs N MPI ranks, same evaluation-bound config, side by side in one run.

    python -m bench.mpi_scaling [--ranks 2] [--generations 20] [--repeats 2]

One process uses all cores through torch's intra-op threads; N ranks split the cores (one
thread each on this 2-core machine) and the population. We compare the median seconds per
generation (the first generation, which probes the strategies, is excluded), check that the
fitness trajectories are identical, and report the bytes rank 0 received per generation.
Writes bench/results/mpi_scaling.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

CONFIG = [
    "run.show_progress=false", "evaluation.every=0", "evaluation.use_scale_baseline=false",
    "evaluation.strategy=batched", "data.test_size=200",
]


def mpiexec() -> str:
    found = Path(sys.executable).with_name("mpiexec")
    path = str(found) if found.exists() else shutil.which("mpiexec")
    if path is None:
        raise SystemExit("mpiexec not found: pip install 'essa-align[mpi]'")
    return path


def run(ranks: int, generations: int, run_dir: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "essa.cli", "train", "--overwrite", "--run-dir", str(run_dir)]
    for item in [*CONFIG, f"run.generations={generations}"]:
        cmd += ["--set", item]
    if ranks > 1:
        cmd = [mpiexec(), "-n", str(ranks), *cmd]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise SystemExit(f"{ranks} rank(s) failed:\n{res.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    gens = [r for r in records if r.get("generation", -1) >= 0]
    return {
        "ranks": ranks,
        "seconds_per_generation": statistics.median(r["seconds"] for r in gens[1:]),
        "fitness": [r["mean_fitness"] for r in gens],
        "comm_bytes_per_generation": statistics.median(r.get("comm_bytes", 0) for r in gens),
        "summary": json.loads((run_dir / "summary.json").read_text()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--generations", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--runs", type=Path, default=Path("runs/bench-mpi"))
    args = parser.parse_args()
    results: dict[int, list[dict[str, Any]]] = {1: [], args.ranks: []}
    for repeat in range(args.repeats):  # interleaved, so drift in machine load hits both alike
        for ranks in results:
            results[ranks].append(run(ranks, args.generations, args.runs / f"r{ranks}-{repeat}"))
    one = statistics.median(r["seconds_per_generation"] for r in results[1])
    many = statistics.median(r["seconds_per_generation"] for r in results[args.ranks])
    same = all(r["fitness"] == results[1][0]["fitness"] for rs in results.values() for r in rs)
    report = {
        "command": f"python -m bench.mpi_scaling --ranks {args.ranks} --generations "
                   f"{args.generations} --repeats {args.repeats}",
        "seconds_per_generation": {"1": one, str(args.ranks): many},
        "speedup": one / many,
        "identical_fitness_trajectories": same,
        "comm_bytes_per_generation": results[args.ranks][0]["comm_bytes_per_generation"],
        "runs": {str(k): v for k, v in results.items()},
    }
    out = Path("bench/results/mpi_scaling.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"1 rank: {one:.3f} s/generation; {args.ranks} ranks: {many:.3f} s/generation; "
          f"speedup x{one / many:.2f}; identical fitness: {same}; "
          f"bytes/generation (rank 0 received): {report['comm_bytes_per_generation']}")
    print(f"(reproduce: {report['command']})")


if __name__ == "__main__":
    main()
