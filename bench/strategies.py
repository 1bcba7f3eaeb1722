"""Population-batched vs merged evaluation, and what `auto` picks, side by side in one run.

    python -m bench.strategies [--populations 8 16 32] [--prompts 16 64 256] [--repeats 3]

For each (population, prompts) cell, every strategy generates the same completions for the same
random candidates around an SFT-like adapter on the bundled demo model; we report the median wall
time per generation over repeats, the batched/merged speed ratio, auto's per-generation time
relative to the better strategy, and auto's one-off probe (its first call, which times both).
Writes bench/results/strategies.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def build(rank: int = 8, seed: int = 0) -> tuple[Any, Any, Any]:
    """The demo base model with a random rank-r LoRA (B != 0) in SVD form."""
    from essa.adapters import SVDAdapter
    from essa.backends.hf import load_model
    from essa.config import AdapterConfig, ModelConfig
    from essa.recipes.sft import make_lora_model

    model, tokenizer = load_model(ModelConfig())
    peft_model = make_lora_model(model, AdapterConfig(rank=rank, lora_alpha=2 * rank))
    gen = torch.Generator().manual_seed(seed)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=gen) * 0.05
    adapter = SVDAdapter.from_peft_model(peft_model, alpha=1.0)
    return peft_model.unload(), tokenizer, adapter


def time_cell(
    model: Any, tokenizer: Any, adapter: Any, population: int, n_prompts: int, repeats: int
) -> dict[str, Any]:
    from essa.backends.evaluator import PopulationEvaluator
    from essa.config import EvaluationConfig, GenerationConfig
    from essa.data.arithmetic import arithmetic_examples

    train, _ = arithmetic_examples()
    prompts = [e.prompt for e in train[:n_prompts]]
    X = np.random.default_rng(1).normal(size=(population, adapter.dim)) * adapter.stds() * 0.5
    gen = GenerationConfig(max_new_tokens=4)
    times: dict[str, list[float]] = {"batched": [], "merged": [], "auto": []}
    outputs: dict[str, Any] = {}
    evaluators = {
        strategy: PopulationEvaluator(
            model,
            tokenizer,
            adapter,
            gen,
            EvaluationConfig(strategy=strategy, micro_batch_size=1024),
        )
        for strategy in times
    }
    # auto times both strategies on its first call (half the candidates each); a run pays
    # that once, so it is reported apart from the per-generation cost.
    start = time.perf_counter()
    outputs["auto_probe"] = evaluators["auto"].completions(X, prompts)
    probe_seconds = time.perf_counter() - start
    outputs["auto_choice"] = evaluators["auto"].chosen[len(prompts)]
    for _ in range(repeats):
        for strategy, evaluator in evaluators.items():
            start = time.perf_counter()
            outputs[strategy] = evaluator.completions(X, prompts)
            times[strategy].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = min(med["batched"], med["merged"])
    return {
        "population": population,
        "prompts": n_prompts,
        "seconds": med,
        "spread": {k: [min(v), max(v)] for k, v in times.items()},
        "batched_speedup": med["merged"] / med["batched"],
        "auto_vs_best": med["auto"] / best,
        "auto_choice": outputs["auto_choice"],
        "auto_probe_seconds": probe_seconds,
        "same_completions": (
            outputs["batched"] == outputs["merged"] == outputs["auto"] == outputs["auto_probe"]
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--populations", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--prompts", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results/strategies.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer, adapter = build()
    rows = []
    for population in args.populations:
        for n_prompts in args.prompts:
            row = time_cell(model, tokenizer, adapter, population, n_prompts, args.repeats)
            rows.append(row)
            print(
                f"P={population:3d} N={n_prompts:4d}  batched {row['seconds']['batched']:.2f}s  "
                f"merged {row['seconds']['merged']:.2f}s  speedup x{row['batched_speedup']:.2f}  "
                f"auto={row['auto_choice']} ({row['auto_vs_best']:.2f} of best, "
                f"probe {row['auto_probe_seconds']:.2f}s)  "
                f"same={row['same_completions']}",
                flush=True,
            )
    meta = {
        "machine": platform.machine(),
        "processor": platform.processor(),
        "threads": args.threads,
        "torch": torch.__version__,
        "repeats": args.repeats,
        "command": "python -m bench.strategies "
        + " ".join(
            [
                f"--populations {' '.join(map(str, args.populations))}",
                f"--prompts {' '.join(map(str, args.prompts))}",
                f"--repeats {args.repeats}",
            ]
        ),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
