"""Prepared GPU check: ESSA generation vs plain generate in bf16 on Qwen2.5-shaped models.

    python -m bench.benchmarks.gpu_check                    # on a GPU: all cells, ends in < 8 minutes
    python -m bench.benchmarks.gpu_check --device cpu --tiny  # smoke test (CI: tests/test_gpu_check.py)

Needs only torch, transformers, peft, numpy and essa-align (no other wheels, nothing to
download): the models are random-initialised with the published shapes of Qwen2.5-0.5B, 1.5B
and 7B (hidden size, layers, heads, KV heads, MLP width, vocabulary), in bfloat16, with a random
rank-8 LoRA (B != 0) on q/k/v/o in SVD form. Prompts are random token ids (a stand-in
tokenizer maps "12 7 99" <-> ids) sharing a 32-token prefix (a system prompt's role; the prefix
cache applies) and of varied length. Random weights do not stop on their own, so rows run to
max_new_tokens; the row-dropping decode is measured on real chat models by
bench/benchmarks/long_completions.py.

Per cell (model, dtype, population P, prompts N, new tokens), after an untimed warm-up each:

- ``plain``: ``generate_texts`` of the P * N rows on the bare model (no adapter);
- ``batched``: ``PopulationEvaluator`` strategy ``batched`` (per-row singular values);
- ``merged``: strategy ``merged``, only in float32 cells (refused in bf16: see
  essa.adapters.merged).

It reports new tokens per second of each, ESSA batched / plain (tokens/s ratio), the peak GPU
memory of each run, and once (on the smallest shape) the candidate separation: two candidates
whose offsets differ by 1e-3 x the SFT singular values, max |logit difference| and its cosine
with the float32 model's difference. Cells are skipped (and listed) once the run nears
``--budget-seconds``. Writes bench/results/gpu_check.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import Row, machine, row, versions

# Published Qwen2.5 shapes: hidden, intermediate, layers, heads, KV heads, vocab, tied.
SHAPES: dict[str, tuple[int, int, int, int, int, int, bool]] = {
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064, False),
    "tiny": (64, 128, 2, 4, 2, 256, True),
}
# (model, dtype, population P, prompts N, max_new_tokens)
GPU_CELLS = [
    ("qwen2.5-0.5b", "bfloat16", 64, 64, 128),
    ("qwen2.5-0.5b", "float32", 16, 32, 64),
    ("qwen2.5-1.5b", "bfloat16", 32, 128, 128),
    ("qwen2.5-7b", "bfloat16", 16, 256, 256),
]
TINY_CELLS = [("tiny", "bfloat16", 2, 4, 4), ("tiny", "float32", 2, 4, 4)]
PREFIX_TOKENS = 32
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class IdTokenizer:
    """Stand-in tokenizer: the text "12 7 99" is the ids [12, 7, 99]; 0 pads, 1 is EOS."""

    pad_token_id = 0
    eos_token_id = 1

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict[str, Any]:
        return {"input_ids": [[int(t) for t in text.split()] for text in texts]}

    def batch_decode(self, rows: torch.Tensor, skip_special_tokens: bool = True) -> list[str]:
        return [" ".join(str(t) for t in row if t > 1) for row in rows.tolist()]


def build(name: str, dtype: torch.dtype, device: torch.device, seed: int) -> tuple[Any, Any]:
    """(bare model on ``device`` in ``dtype``, SVDAdapter of a random rank-8 LoRA on it)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from essa.adapters import SVDAdapter
    from essa.config import AdapterConfig
    from essa.gradient.sft import make_lora_model

    hidden, inter, layers, heads, kv, vocab, tied = SHAPES[name]
    config = Qwen2Config(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
        tie_word_embeddings=tied, max_position_embeddings=4096, rope_theta=1e6,
        pad_token_id=0, eos_token_id=1, bos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in the target dtype: no fp32 copy of a 7B
    try:
        with device:
            model = Qwen2ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    peft_model = make_lora_model(model, AdapterConfig(rank=8, lora_alpha=16))
    generator = torch.Generator(device=device).manual_seed(seed)
    for param_name, param in peft_model.named_parameters():
        if "lora_B" in param_name:
            noise = torch.randn(param.shape, generator=generator, device=device)
            param.data = (noise * 0.02).to(param.dtype)
    adapter = SVDAdapter.from_peft_model(peft_model, alpha=1.0)
    return peft_model.unload(), adapter


def prompts(n: int, vocab: int, seed: int) -> list[str]:
    """n prompts: a shared 32-token prefix, then 16 to 96 tokens of their own."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(2, vocab, PREFIX_TOKENS)
    own = [rng.integers(2, vocab, rng.integers(16, 97)) for _ in range(n)]
    return [" ".join(map(str, np.concatenate([prefix, o]))) for o in own]


def timed(fn: Any, device: torch.device) -> tuple[float, float | None]:
    """(seconds, peak GPU GiB or None) of ``fn()``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return seconds, peak


def run_cell(cell: tuple[str, str, int, int, int], device: torch.device, seed: int) -> dict:
    from essa.backends.evaluator import PopulationEvaluator
    from essa.backends.generate import generate_texts
    from essa.config import EvaluationConfig, GenerationConfig

    name, dtype_name, population, n_prompts, new_tokens = cell
    model, adapter = build(name, DTYPES[dtype_name], device, seed)
    tokenizer = IdTokenizer()
    texts = prompts(n_prompts, SHAPES[name][5], seed)
    x = np.random.default_rng(seed).normal(size=(population, adapter.dim)) * adapter.stds() * 0.2
    gen = GenerationConfig(max_new_tokens=new_tokens)
    cfg = EvaluationConfig()
    rows = [t for _ in range(population) for t in texts]  # (P * N,) candidate-major
    tokens: dict[str, int] = {}

    def plain(limit: int = len(rows), max_new: int = new_tokens) -> None:
        _, tokens["plain"] = generate_texts(
            model, tokenizer, rows[:limit], GenerationConfig(max_new_tokens=max_new),
            micro_batch_size=cfg.micro_batch_size, use_prefix_cache=cfg.use_prefix_cache,
        )  # fmt: skip

    def essa(strategy: str, pop: np.ndarray = x, generation: GenerationConfig = gen) -> None:
        strategy_cfg = EvaluationConfig(strategy=strategy)  # type: ignore[arg-type]
        evaluator = PopulationEvaluator(model, tokenizer, adapter, generation, strategy_cfg)
        evaluator.completions(pop, texts)
        tokens[strategy] = evaluator.stats.new_tokens

    runs = {"plain": plain, "batched": lambda: essa("batched")}
    if dtype_name == "float32":
        runs["merged"] = lambda: essa("merged")
    result: dict[str, Any] = {
        "model": name, "dtype": dtype_name, "population": population, "prompts": n_prompts,
        "max_new_tokens": new_tokens, "micro_batch_size": cfg.micro_batch_size,
        "runs": {}, "merged": None if dtype_name == "float32" else "refused in bfloat16",
    }  # fmt: skip
    warm = GenerationConfig(max_new_tokens=2)
    plain(limit=2, max_new=2)
    essa("batched", x[:1], warm)
    if "merged" in runs:
        essa("merged", x[:1], warm)
    for key, fn in runs.items():
        seconds, peak = timed(fn, device)
        result["runs"][key] = {
            "seconds": seconds, "new_tokens": tokens[key],
            "tokens_per_second": tokens[key] / seconds, "peak_gpu_gib": peak,
        }  # fmt: skip
        print(f"  {key}: {seconds:.2f} s, {tokens[key] / seconds:.0f} tokens/s, "
              f"peak {peak if peak is None else round(peak, 2)} GiB", flush=True)  # fmt: skip
    plain_rate = result["runs"]["plain"]["tokens_per_second"]
    result["essa_vs_plain_tokens_per_second"] = {
        key: run["tokens_per_second"] / plain_rate
        for key, run in result["runs"].items()
        if key != "plain"
    }
    return result  # the model is freed with this frame


@torch.no_grad()
def separation(device: torch.device, seed: int, name: str) -> dict[str, float]:
    """Two candidates 1e-3 x stds apart: their logit difference in bf16 and in fp32."""
    from essa.adapters import PopulationLoRA, candidate_rows

    ids = torch.as_tensor(
        [[int(t) for t in p.split()][:48] for p in prompts(4, SHAPES[name][5], seed)],
        device=device,
    )  # (4, 48)
    fp32_model, adapter = build(name, torch.float32, device, seed)
    first = np.random.default_rng(seed).normal(size=adapter.dim) * adapter.stds() * 0.2
    x = np.stack([first, first + 1e-3 * adapter.stds()])  # (2, D)
    differences = {}
    for dtype_name in ("bfloat16", "float32"):
        # The same weights: the bf16 model is the fp32 one rounded.
        model = (
            copy.deepcopy(fp32_model).to(torch.bfloat16) if dtype_name == "bfloat16" else fp32_model
        )
        with PopulationLoRA(model, adapter) as pop:
            pop.set_population(x)
            pop.set_rows(candidate_rows(2, len(ids)))
            logits = model(input_ids=ids.repeat(2, 1)).logits[:, -1].float()  # (8, V)
        differences[dtype_name] = (logits[len(ids) :] - logits[: len(ids)]).flatten()
        del model
    bf16, fp32 = differences["bfloat16"], differences["float32"]
    return {
        "model": name,
        "max_abs_difference_bf16": float(bf16.abs().max()),
        "max_abs_difference_fp32": float(fp32.abs().max()),
        "cosine_bf16_vs_fp32": float(torch.nn.functional.cosine_similarity(bf16, fp32, dim=0)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    parser.add_argument("--budget-seconds", type=float, default=420.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/gpu_check.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "bench.benchmarks.gpu_check: no CUDA device (use --device cpu --tiny to smoke-test)"
        )
    start = time.perf_counter()
    cells = TINY_CELLS if args.tiny else GPU_CELLS
    smallest = cells[0][0]
    print(f"separation on {smallest} ...", flush=True)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "separation": separation(device, args.seed, smallest),
        "cells": [],
        "skipped": [],
    }
    print(f"  {result['separation']}", flush=True)
    for cell in cells:
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_seconds:
            result["skipped"].append(list(cell))
            continue
        print(f"{cell} (at {elapsed:.0f} s) ...", flush=True)
        result["cells"].append(run_cell(cell, device, args.seed))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next cell builds a different model
    result["seconds"] = time.perf_counter() - start
    command = "python -m bench.benchmarks.gpu_check" + (
        f" --device {args.device} --tiny" if args.tiny else ""
    )
    full = {"command": command, "machine": machine(), "versions": versions(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **result}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(full, indent=2) + "\n")
    print(f"wrote {out} ({result['seconds']:.0f} s)")


def report_rows(result: dict[str, Any]) -> list[Row]:
    """ESSA batched / plain tokens/s per cell, and the bf16 candidate separation."""
    rows = []
    for cell in result["cells"]:
        runs = cell["runs"]
        note = ", ".join(
            f"{k} {r['tokens_per_second']:.0f} tok/s"
            + (f" (peak {r['peak_gpu_gib']:.1f} GiB)" if r.get("peak_gpu_gib") else "")
            for k, r in runs.items()
        )
        if cell.get("merged"):
            note += f"; merged {cell['merged']}"
        shape = f"{cell['population']} x {cell['prompts']} prompts, {cell['max_new_tokens']} tok"
        rows.append(
            row(
                f"{result['device']}: ESSA batched vs plain generate, tokens/s "
                f"({cell['model']} shape, {cell['dtype']}, {shape})",
                f"x{cell['essa_vs_plain_tokens_per_second']['batched']:.2f}",
                None,
                None,
                note,
            )
        )
    sep = result["separation"]
    rows.append(
        row(
            f"{result['device']}: candidates 1e-3 x stds apart, bf16 ({sep['model']} shape)",
            f"max |dlogit| {sep['max_abs_difference_bf16']:.3g} (fp32 "
            f"{sep['max_abs_difference_fp32']:.3g}), cosine {sep['cosine_bf16_vs_fp32']:.2f}",
            "> 0 (apart)",
            sep["max_abs_difference_bf16"] > 0,
            "skipped cells: " + (", ".join(map(str, result["skipped"])) or "none"),
        )
    )
    return rows


if __name__ == "__main__":
    main()
