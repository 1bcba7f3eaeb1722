"""Population-batched vs merged evaluation, and what `auto` picks, side by side in one run.

    python -m bench.benchmarks.strategies [--populations 8 32 64] [--prompts 16 64 256] [--repeats 2]
                               [--max-sequences 8192] [--merged-candidates 8] [--threads 2]

For each (population P, prompts N) cell, both strategies generate the same completions (checked)
for the same random candidates around a rank-8 LoRA on the bundled demo model (greedy, 4 new
tokens). Per cell, in this order:

1. ``auto`` sees the population first, as in a run: each probe times each strategy on half the
   candidates; it decides once the summed per-candidate costs differ by 10%, or after 3 probes
   (``essa.backends.evaluator.MAX_PROBES``). The probes' wall time is a one-off cost.
2. ``batched`` and ``merged`` are timed alternately, ``--repeats`` times (medians and spread).

After its probe, ``auto`` runs exactly the code of the strategy it chose (``PopulationEvaluator.
_run``), so its per-generation time is that strategy's: we report ``auto_vs_best`` = median of
auto's choice / median of the faster strategy, and check it is <= 1.10 in every cell.

Deviations, to fit the suite's budget on 2 cores (both stated in the JSON and the table):

- ``merged`` costs P independent merge/generate/restore passes of N rows, linear in P by
  construction; for P > ``--merged-candidates`` it is timed on that many candidates and scaled
  by P / that number (``merged_extrapolated`` in the JSON);
- cells with P x N > ``--max-sequences`` are skipped.

Writes bench/results/strategies.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

from bench.common import Row, median_spread, row, write_result

AUTO_TOLERANCE = 1.10
TIE = 1.05  # strategies closer than this are reported as tied
NEW_TOKENS = 4


def build(rank: int = 8, seed: int = 0) -> tuple[Any, Any, Any]:
    """The demo base model with a random rank-r LoRA (B != 0) in SVD form."""
    from essa.adapters import SVDAdapter
    from essa.backends.models import load_model
    from essa.config import AdapterConfig, ModelConfig
    from essa.gradient.sft import make_lora_model

    model, tokenizer = load_model(ModelConfig())
    peft_model = make_lora_model(model, AdapterConfig(rank=rank, lora_alpha=2 * rank))
    gen = torch.Generator().manual_seed(seed)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=gen) * 0.05
    adapter = SVDAdapter.from_peft_model(peft_model, alpha=1.0)
    return peft_model.unload(), tokenizer, adapter


def time_cell(
    setup: tuple[Any, Any, Any],
    population: int,
    n_prompts: int,
    repeats: int,
    merged_candidates: int,
) -> dict[str, Any]:
    from essa.backends.evaluator import PopulationEvaluator
    from essa.config import EvaluationConfig, GenerationConfig
    from essa.data.arithmetic import arithmetic_examples

    model, tokenizer, adapter = setup
    prompts = [e.prompt for e in arithmetic_examples()[0][:n_prompts]]
    x = np.random.default_rng(1).normal(size=(population, adapter.dim)) * adapter.stds() * 0.5
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS)
    evaluators = {
        s: PopulationEvaluator(model, tokenizer, adapter, gen, EvaluationConfig(strategy=s))
        for s in ("auto", "batched", "merged")
    }
    start, probes = time.perf_counter(), 0
    while len(prompts) not in evaluators["auto"].chosen:  # as the first generations of a run
        auto_out = evaluators["auto"].completions(x, prompts)  # probes on the whole population
        probes += 1
    probe_seconds = time.perf_counter() - start
    choice = evaluators["auto"].chosen[len(prompts)]
    m = min(population, merged_candidates)
    scale = {"batched": 1.0, "merged": population / m}
    rows = {"batched": x, "merged": x[:m]}
    times: dict[str, list[float]] = {"batched": [], "merged": []}
    outputs: dict[str, Any] = {}
    for _ in range(repeats):
        for strategy in times:
            start = time.perf_counter()
            outputs[strategy] = evaluators[strategy].completions(rows[strategy], prompts)
            times[strategy].append((time.perf_counter() - start) * scale[strategy])
    med = {k: statistics.median(v) for k, v in times.items()}
    best = min(med, key=med.__getitem__)
    return {
        "population": population,
        "prompts": n_prompts,
        "seconds": {k: median_spread(v) for k, v in times.items()},
        "merged_extrapolated": m < population,
        "batched_speedup": med["merged"] / med["batched"],
        "better": best,
        "auto_choice": choice,
        "auto_vs_best": med[choice] / med[best],
        "auto_probe_seconds": probe_seconds,
        "auto_probes": probes,
        "auto_probe_per_candidate": evaluators["auto"].stats.strategy_seconds,
        "same_completions": outputs["batched"][:m] == outputs["merged"] == auto_out[:m]
        and outputs["batched"] == auto_out,
    }


def crossover(cells: list[dict[str, Any]]) -> str:
    """Where each strategy is faster by more than TIE, in words."""

    def where(cells: list[dict[str, Any]]) -> str:
        return ", ".join(f"P={c['population']}/N={c['prompts']}" for c in cells) or "no cell"

    merged = [c for c in cells if c["batched_speedup"] < 1 / TIE]
    batched = [c for c in cells if c["batched_speedup"] > TIE]
    tied = [c for c in cells if c not in merged and c not in batched]
    return (
        f"batched faster at {where(batched)}; merged faster at {where(merged)}; "
        f"within {100 * (TIE - 1):.0f}% at {where(tied)}"
    )


def report_rows(result: dict[str, Any]) -> list[Row]:
    cells = result["cells"]
    rows = []
    for c in cells:
        seconds = c["seconds"]
        note = (
            f"batched {seconds['batched']['median']:.2f} s, merged {seconds['merged']['median']:.2f}"
            f" s{' (scaled from fewer candidates)' if c['merged_extrapolated'] else ''}; "
            f"auto probe {c['auto_probe_seconds']:.2f} s over {c.get('auto_probes', 1)} "
            "population(s)"
        )
        if not c["same_completions"]:
            note += "; COMPLETIONS DIFFER"
        met = c["auto_vs_best"] <= AUTO_TOLERANCE
        if not met:
            probe = c["auto_probe_per_candidate"]
            note += (
                f"; missed: auto chose {c['auto_choice']}: its probes saw "
                f"merged/batched x{probe['merged'] / probe['batched']:.2f} per candidate, the "
                f"repeats x{c['batched_speedup']:.2f} (probe noise)"
            )
        rows.append(
            row(
                f"batched vs merged, P={c['population']} x N={c['prompts']} prompts",
                f"x{c['batched_speedup']:.2f} (auto: {c['auto_choice']}, "
                f"x{c['auto_vs_best']:.2f} of best)",
                f"auto <= {AUTO_TOLERANCE:.2f}x best",
                met,
                note,
            )
        )
    worst = max(c["auto_vs_best"] for c in cells)
    rows.append(
        row(
            "auto within 10% of the better strategy in every cell",
            f"worst x{worst:.2f}; {crossover(cells)}",
            f"<= {AUTO_TOLERANCE:.2f}x everywhere",
            worst <= AUTO_TOLERANCE,
            f"{len(cells)} cells; skipped (P x N > budget): "
            + (", ".join(result.get("skipped", [])) or "none"),
        )
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--populations", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--prompts", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-sequences", type=int, default=8192)
    parser.add_argument("--merged-candidates", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    setup = build()
    cells, skipped = [], []
    for population in args.populations:
        for n_prompts in args.prompts:
            if population * n_prompts > args.max_sequences:
                skipped.append(f"P={population}/N={n_prompts}")
                continue
            c = time_cell(setup, population, n_prompts, args.repeats, args.merged_candidates)
            cells.append(c)
            print(
                f"P={population:3d} N={n_prompts:4d}  batched {c['seconds']['batched']['median']:.2f}s"
                f"  merged {c['seconds']['merged']['median']:.2f}s  x{c['batched_speedup']:.2f}  "
                f"auto={c['auto_choice']} (x{c['auto_vs_best']:.2f} of best, probe "
                f"{c['auto_probe_seconds']:.2f}s)  same={c['same_completions']}",
                flush=True,
            )
    command = (
        f"python -m bench.benchmarks.strategies --populations {' '.join(map(str, args.populations))} "
        f"--prompts {' '.join(map(str, args.prompts))} --repeats {args.repeats} "
        f"--max-sequences {args.max_sequences} --merged-candidates {args.merged_candidates} "
        f"--threads {args.threads}"
    )
    result = {
        "seeds": {"candidates": 1, "adapter": 0},
        "max_new_tokens": NEW_TOKENS,
        "cells": cells,
        "skipped": skipped,
        "crossover": crossover(cells),
    }
    write_result("strategies", result, command)
    print(f"{crossover(cells)}\n(reproduce: {command})")


if __name__ == "__main__":
    main()
