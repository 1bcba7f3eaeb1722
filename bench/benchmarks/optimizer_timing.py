"""Optimizer ask+tell seconds vs search dimension, and its share of a generation's time.

    python -m bench.benchmarks.optimizer_timing [--dims 100 1000 10000] [--populations 16 64]
                                     [--iterations 10] [--max-seconds 20] [--threads 2]

For each optimizer (``cma_es`` with full covariance, ``cma_es`` sep, ``openai_es``), dimension D
and population P, we build the optimizer (timed apart: full CMA allocates a D x D covariance)
and time ``ask`` + ``tell`` on a sphere fitness for up to ``--iterations`` generations or
``--max-seconds``, whichever ends first; the row says how many were measured. Full CMA-ES
recomputes its eigendecomposition lazily, every few generations (pycma), so a short window can
miss that O(D^3) step at large D: ``eigen_updates`` counts the ones that happened in the timed
window and the median is reported with the max (which includes them when they happened).

The share of a generation uses a measured generation on the same machine in the same run: the
demo model (the embedded config's 64 prompts, 8 new tokens, batched evaluation) with P random
candidates around a rank-8 LoRA. The demo model is tiny, so this share is an upper bound for
real models, whose generations take far longer. Writes bench/results/optimizer_timing.json.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from bench.common import Row, fmt_spread, median_spread, row, write_result

METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "cma_es full": ("cma_es", {"variant": "full"}),
    "cma_es sep": ("cma_es", {"variant": "sep"}),
    "openai_es": ("openai_es", {}),
}


def time_optimizer(
    method: str, dim: int, population: int, iterations: int, max_seconds: float
) -> dict[str, Any]:
    """Init seconds and per-generation ask+tell seconds on a sphere (maximising -|x - 1|^2)."""
    from essa.optimizers import make_optimizer

    name, options = METHODS[method]
    start = time.perf_counter()
    opt = make_optimizer(name, dim, population_size=population, sigma0=0.5, seed=0, **options)
    init_seconds = time.perf_counter() - start
    _step(opt)  # the first generation pays one-off costs (lazy imports, buffers): untimed
    es = getattr(opt, "_es", None)  # the pycma object, to count eigendecompositions
    updates_before = getattr(getattr(es, "sm", None), "count_eigen", None)
    seconds: list[float] = []
    spent = 0.0
    while not seconds or (len(seconds) < iterations and spent < max_seconds):
        start = time.perf_counter()
        _step(opt)
        seconds.append(time.perf_counter() - start)
        spent += seconds[-1]
    updates_after = getattr(getattr(es, "sm", None), "count_eigen", None)
    eigen = None if updates_before is None else int(updates_after - updates_before)
    return {
        "method": method,
        "dim": dim,
        "population": population,
        "init_seconds": init_seconds,
        "ask_tell_seconds": median_spread(seconds),
        "iterations": len(seconds),
        "capped": len(seconds) < iterations,
        "eigen_updates": eigen,
    }


def _step(opt: Any) -> None:
    population_x = opt.ask()  # (P, D)
    fitness = -np.sum((population_x - 1.0) ** 2, axis=1)  # (P,)
    opt.tell(population_x, fitness)


def generation_seconds(population: int, repeats: int) -> dict[str, Any]:
    """Median seconds of one demo generation (P candidates x 64 prompts, batched, 8 tokens)."""
    from bench.benchmarks.strategies import build
    from essa.backends.evaluator import PopulationEvaluator
    from essa.config import EvaluationConfig, GenerationConfig
    from essa.data.arithmetic import arithmetic_examples

    model, tokenizer, adapter = build()
    prompts = [e.prompt for e in arithmetic_examples()[0][:64]]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(population, adapter.dim)) * adapter.stds() * 0.5  # (P, D)
    evaluator = PopulationEvaluator(
        model,
        tokenizer,
        adapter,
        GenerationConfig(max_new_tokens=8),
        EvaluationConfig(strategy="batched"),
    )
    evaluator.completions(x[:2], prompts[:2])  # first-call costs, untimed
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        evaluator.completions(x, prompts)
        seconds.append(time.perf_counter() - start)
    return {"population": population, "prompts": 64, "seconds": median_spread(seconds)}


def report_rows(result: dict[str, Any]) -> list[Row]:
    """One row per (method, dimension): every population's ask+tell and share of a generation."""
    gens = {g["population"]: g["seconds"]["median"] for g in result["generation"]}
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for cell in result["cells"]:
        groups.setdefault((cell["method"], cell["dim"]), []).append(cell)
    rows = []
    for (method, dim), cells in groups.items():
        values, notes = [], []
        for cell in cells:
            t, p = cell["ask_tell_seconds"], cell["population"]
            share = t["median"] / (t["median"] + gens[p]) if p in gens else None
            shared = "" if share is None else f", {100 * share:.1f}% of a demo generation"
            values.append(
                f"P={p}: {1e3 * t['median']:.2f} ms [{1e3 * t['min']:.2f}–{1e3 * t['max']:.2f}, "
                f"n={t['n']}]{shared}"
            )
            note = f"P={p}: init {cell['init_seconds']:.2f} s"
            if cell["capped"]:
                note += f", time cap after {cell['iterations']} generations"
            if cell["eigen_updates"] is not None:
                note += f", {cell['eigen_updates']} eigendecompositions timed"
            notes.append(note)
        if any(c["eigen_updates"] == 0 for c in cells):
            notes.append("pycma's lazy O(D^3) eigendecomposition fell outside the window")
        rows.append(row(f"{method} ask+tell, D={dim:,}", "; ".join(values), None, None,
                        "; ".join(notes)))  # fmt: skip
    for g in result["generation"]:
        rows.append(
            row(
                f"demo generation (P={g['population']} x 64 prompts, batched): the shares' base",
                fmt_spread(g["seconds"], 3, " s"),
                note="measured in the same run",
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--populations", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--max-seconds", type=float, default=20.0, help="cap per cell")
    parser.add_argument("--repeats", type=int, default=5, help="demo generations timed")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    import cma  # noqa: F401  (imported before timing: it pulls in matplotlib, ~1 s)

    cells = []
    for method in args.methods:
        for dim in args.dims:
            for population in args.populations:
                cell = time_optimizer(method, dim, population, args.iterations, args.max_seconds)
                print(
                    f"{method:12s} D={dim:6d} P={population:3d} init {cell['init_seconds']:.2f}s "
                    f"ask+tell {fmt_spread(cell['ask_tell_seconds'], 4, 's')}",
                    flush=True,
                )
                cells.append(cell)
    generation = [generation_seconds(p, args.repeats) for p in args.populations]
    command = (
        f"python -m bench.benchmarks.optimizer_timing --dims {' '.join(map(str, args.dims))} "
        f"--populations {' '.join(map(str, args.populations))} --methods "
        + " ".join(f"'{m}'" for m in args.methods)
        + f" --iterations {args.iterations} --max-seconds {args.max_seconds:g} "
        f"--repeats {args.repeats} --threads {args.threads}"
    )
    result = {"seeds": [0], "cells": cells, "generation": generation}
    write_result("optimizer_timing", result, command, extra_versions=("cma",))
    for line in report_rows(result):
        print(f"{line['row']}: {line['value']} ({line['note']})")
    print(f"(reproduce: {command})")


if __name__ == "__main__":
    main()
