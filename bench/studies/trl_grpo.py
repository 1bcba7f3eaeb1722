"""TRL's GRPOTrainer on our task, model, SFT start, reward and budget (a bench-only peer).

    python -m bench.studies.trl_grpo [--config configs/grpo_demo.yaml] [--set k=v ...] [--run-dir DIR]

Reads an essa-align GRPO config (the same file and ``--set`` overrides `essa train` takes),
builds the same base model, SFT adapter (``adapter.path``, else the SFT stage trained exactly as
`essa train` does), the same training prompts rendered with the same template, the same reward
and the same held-out split, and trains that adapter with TRL 1.16's ``GRPOTrainer`` (CPU,
``use_vllm=False``, fp32, ``report_to="none"``). Held-out accuracy is measured greedily with our
own evaluation code (``essa.gradient.heldout.heldout_accuracy``'s helpers) before training, every
``evaluation.every`` steps and at the end, outside the timed steps. The run directory gets
``metrics.jsonl`` and ``summary.json`` in our format (so ``essa compare`` reads it next to ESSA
and GRPO runs) and the trained adapter; bench/results/trl_grpo.json gets the summary, the TRL
arguments used and the mismatches below. Peak RSS is this process's VmHWM: run it in a fresh
process (as bench/studies/peers.py does) for a number that compares.

Settings mapped one to one: G (``num_generations``), prompts per step x G completions per
optimizer step (``per_device_train_batch_size`` x ``gradient_accumulation_steps``), learning
rate, its schedule and warm-up, AdamW weight decay, gradient clipping, beta (KL k3 to a frozen
copy of the SFT adapter: TRL adds a "ref" adapter when it is given a PeftModel and beta != 0),
epsilon low/high, ``loss_type`` (grpo / dr_grpo / dapo), ``scale_rewards`` (group; none for
dr_grpo), truncated-completion masking (dapo), sampling temperature / top_p / top_k=0,
max_new_tokens, log-probs at the sampling temperature, mu (``num_iterations``), seed.

Mismatches that remain (also written to the JSON):
* DAPO's dynamic sampling (resampling away groups whose rewards are all equal) does not exist in
  TRL: every group is trained on, the all-equal ones with advantage 0.
* The std epsilon is TRL's 1e-4 for every loss type (our dapo preset uses verl's 1e-6): no
  effect on 0/1 rewards.
* Prompt order and sampling noise differ: TRL shuffles the training prompts once per epoch and
  walks through them; our recipe draws an independent subset each step; RNG streams differ.
* With ``num_iterations`` > 1 TRL counts every reuse of a generation batch as a step (and
  steps its LR schedule there); ``max_steps`` is set to generations x mu to keep the budget.
* Our other GRPO variants (ngrpo, w_reinforce, psr, nsr, dcpo) and ``grpo.trainable:
  singular_values`` have no TRL equivalent and are refused.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import row, write_result

TRL_LOSSES = ("grpo", "dr_grpo", "dapo")
MISMATCHES = [
    "dapo dynamic sampling (resampling all-equal groups) is not in TRL: all groups are trained on",
    "std epsilon is TRL's 1e-4 for every loss type (our dapo preset: 1e-6); no effect on 0/1 "
    "rewards",
    "prompt order and sampling RNG differ (TRL: per-epoch shuffle; ours: a fresh subset per step)",
    "with num_iterations > 1 TRL counts each reuse of a batch as a step (max_steps = generations "
    "x mu)",
]


@dataclass
class StepLog:
    """What the reward wrapper and the callback collect for the current step."""

    rewards: list[float] = field(default_factory=list)
    new_tokens: int = 0
    started: float = 0.0


def trl_arguments(cfg: Any, output_dir: Path) -> dict[str, Any]:
    """GRPOConfig keyword arguments equivalent to ``cfg.grpo`` (see the module docstring)."""
    from essa.errors import UserError
    from essa.gradient import losses as grpo_losses

    g = cfg.grpo
    if g.loss not in TRL_LOSSES:
        raise UserError(
            f"grpo.loss={g.loss} has no TRL loss_type (TRL runs {', '.join(TRL_LOSSES)})"
        )
    if g.trainable != "lora":
        raise UserError("grpo.trainable=singular_values has no TRL equivalent; use lora")
    completions = g.prompts_per_step * g.group_size
    if completions % g.grad_accumulation:
        raise UserError(
            f"grpo.grad_accumulation={g.grad_accumulation} must divide prompts_per_step x "
            f"group_size = {completions} for TRL's equal micro-batches"
        )
    variant = grpo_losses.get_variant(g.loss)
    return {
        "output_dir": str(output_dir),
        "use_cpu": True,
        "bf16": False,
        "fp16": False,
        "report_to": "none",
        "use_vllm": False,
        "disable_tqdm": True,
        "save_strategy": "no",
        "logging_steps": 1,
        "seed": cfg.run.seed,
        "max_steps": cfg.run.generations * g.num_iterations,
        "num_generations": g.group_size,
        "per_device_train_batch_size": completions // g.grad_accumulation,
        "gradient_accumulation_steps": g.grad_accumulation,
        "steps_per_generation": g.grad_accumulation,
        "num_iterations": g.num_iterations,
        "learning_rate": g.lr,
        "lr_scheduler_type": g.lr_schedule,
        "warmup_steps": g.lr_warmup_steps,
        "weight_decay": g.weight_decay,
        "max_grad_norm": g.max_grad_norm if g.max_grad_norm > 0 else 1e30,
        "beta": variant.beta if g.beta is None else g.beta,
        "epsilon": variant.epsilon_low if g.epsilon_low is None else g.epsilon_low,
        "epsilon_high": variant.epsilon_high if g.epsilon_high is None else g.epsilon_high,
        "loss_type": g.loss,
        "scale_rewards": "none" if variant.advantage == "centered" else "group",
        "mask_truncated_completions": variant.use_truncation_mask,
        "temperature": g.temperature,
        "top_p": cfg.generation.top_p,
        "top_k": 0,
        "max_completion_length": cfg.generation.max_new_tokens,
        "disable_dropout": True,
    }


def make_reward(reward: Any, log: StepLog, pad_token_id: int) -> Any:
    """Our reward as a TRL reward function; records the step's rewards and generated tokens."""

    def math_reward(
        prompts: list[str], completions: list[str], answer: list[str], **kwargs: Any
    ) -> list[float | None]:
        scores = reward(list(completions), list(answer), list(prompts))
        log.rewards.extend(math.nan if s is None else float(s) for s in scores)
        # As our recipe counts: completion tokens other than pad (TRL cuts after the first EOS).
        log.new_tokens += sum(
            sum(token != pad_token_id for token in ids) for ids in kwargs["completion_ids"]
        )
        return scores

    math_reward.__name__ = f"essa_{getattr(reward, 'name', 'reward')}"
    return math_reward


def run(cfg: Any, run_dir: Path, console: Any = print) -> dict[str, Any]:
    """Train ``cfg``'s SFT adapter with TRL's GRPOTrainer; write run_dir; return the summary."""
    import torch
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from essa.backends.memory import memory_metrics, model_bytes
    from essa.backends.models import load_model
    from essa.config import dump_config
    from essa.data.task import load_task
    from essa.gradient.data import TaskData
    from essa.rewards.base import DRAW_KEYS
    from essa.rewards.loading import load_reward
    from essa.rundir import MetricsLog, atomic_write_json
    from essa.setup import load_or_train_adapter, seed_everything

    wall_start = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    arguments = trl_arguments(cfg, run_dir / "trl")
    seed_everything(cfg.run.seed)
    task = load_task(cfg.data, cfg.run.seed)
    model, tokenizer = load_model(cfg.model)
    base_bytes = model_bytes(model)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    peft_model, sft_dir = load_or_train_adapter(cfg, model, tokenizer, task, run_dir)
    data = TaskData.build(task, cfg.data, tokenizer, cfg.grpo.train_examples)
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    metrics.truncate_after(-2)
    baseline = evaluate(peft_model, tokenizer, data, cfg)
    metrics.write({"generation": -1, "event": "baseline", "heldout_accuracy": baseline})
    console(f"TRL GRPO ({cfg.grpo.loss}): held-out baseline {baseline:.3f}")
    log = StepLog()
    dataset = Dataset.from_list(
        [
            {"prompt": p, "answer": e.answer}
            for p, e in zip(data.train_prompts, data.train, strict=True)
        ]
    )
    trainer = GRPOTrainer(
        model=peft_model,
        reward_funcs=make_reward(
            # TRL calls the reward with its three lists: a reward with random draws (random,
            # noisy) then draws in call order, as from one seeded generator.
            load_reward(
                cfg.reward,
                recipe="GRPO",
                groups=True,
                provides=frozenset({DRAW_KEYS}),
                deadline=False,
            ),
            log,
            tokenizer.pad_token_id,
        ),
        args=GRPOConfig(**arguments),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[_callback(cfg, data, tokenizer, metrics, log, console)],
    )
    trainer.remove_callback(PrinterCallback)  # our callback reports; TRL's dicts go unprinted
    for name, param in trainer.model.named_parameters():  # train the SFT copy, never "ref"
        param.requires_grad_("lora_" in name and ".default." in name)
    trainer.train()
    final = evaluate(trainer.model, tokenizer, data, cfg)
    adapter_dir = run_dir / "adapter"
    trainer.model.save_pretrained(str(adapter_dir), selected_adapters=["default"])
    summary = {
        "algorithm": "trl_grpo",
        "label": f"trl grpo ({cfg.grpo.loss}, lora)",
        "loss": cfg.grpo.loss,
        "trainable": "lora",
        "baseline_accuracy": baseline,
        "final_accuracy": final,
        "improvement": final - baseline,
        "generations": cfg.run.generations,
        "wall_seconds": round(time.perf_counter() - wall_start, 2),
        "adapter_dir": str(adapter_dir),
        "sft_adapter_dir": sft_dir,
        "test_size": len(data.test),
        "trl_arguments": arguments,
        "mismatches": MISMATCHES,
        "torch_threads": torch.get_num_threads(),
        **memory_metrics(base_bytes),
    }
    atomic_write_json(run_dir / "summary.json", summary)
    console(f"held-out accuracy {baseline:.3f} -> {final:.3f}; adapter: {adapter_dir}")
    return summary


def evaluate(model: Any, tokenizer: Any, data: Any, cfg: Any) -> float:
    """Greedy held-out accuracy with our evaluation code (the same split and helper as GRPO)."""
    import torch

    from essa.backends.generate import generate_texts
    from essa.evaluation import heldout_metric, score_heldout

    was_training = model.training
    model.eval()
    with torch.no_grad():
        texts, _ = generate_texts(
            model,
            tokenizer,
            data.test_prompts,
            cfg.generation,
            micro_batch_size=cfg.evaluation.micro_batch_size,
        )
    model.train(was_training)
    _, metric = heldout_metric(cfg)  # evaluation.metric, as the recipes score held-out
    return score_heldout(metric, texts, data.test, data.test_prompts)[0]


def _callback(cfg: Any, data: Any, tokenizer: Any, metrics: Any, log: StepLog, console: Any) -> Any:
    """A TrainerCallback that times each step and writes our metrics records."""
    from transformers import TrainerCallback

    every = cfg.evaluation.every * cfg.grpo.num_iterations

    class MetricsCallback(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            log.started = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seconds = time.perf_counter() - log.started  # generation, reward, loss, update
            step = state.global_step - 1
            rewards = [r for r in log.rewards if not math.isnan(r)]
            record: dict[str, Any] = {
                "generation": step,
                "mean_reward": sum(rewards) / len(rewards) if rewards else None,
                "new_tokens": log.new_tokens,
                "seconds": round(seconds, 4),
            }
            log.rewards.clear()
            log.new_tokens = 0
            if every and (step + 1) % every == 0:
                record["heldout_accuracy"] = evaluate(kwargs["model"], tokenizer, data, cfg)
                console(f"step {step + 1}: held-out {record['heldout_accuracy']:.3f}")
            metrics.write(record)

    return MetricsCallback()


def report_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows for docs/performance.md (bench/suite.py)."""
    s = result["summary"]
    note = f"loss {s['loss']}; measured under load" + (
        "; mismatches: " + "; ".join(s["mismatches"][:1]) if s["loss"] == "dapo" else ""
    )
    return [
        row(
            "TRL GRPOTrainer on the demo task: held-out accuracy SFT start -> final",
            f"{s['baseline_accuracy']:.3f} -> {s['final_accuracy']:.3f}",
            note=note,
        ),
        row(
            "TRL GRPOTrainer: wall s, peak RSS MB",
            f"{s['wall_seconds']:.0f} s, {s['peak_rss_mb']:.0f} MB",
            note="one process, VmHWM",
        ),
    ]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=None, help="default: the embedded demo")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--run-dir", type=Path, default=Path("runs/bench-trl-grpo"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--no-result",
        action="store_true",
        help="only the run dir (bench/studies/peers.py runs it so)",
    )
    return parser.parse_args(argv)


def command_line(args: argparse.Namespace) -> str:
    parts = [
        "python -m bench.studies.trl_grpo",
        f"--threads {args.threads}",
        f"--run-dir {args.run_dir}",
    ]
    if args.config is not None:
        parts.append(f"--config {args.config}")
    parts += [f"--set {o}" for o in args.overrides]
    return " ".join(parts)


def main(argv: Sequence[str] | None = None) -> None:
    import logging

    from essa.config import ConfigError, load_config
    from essa.errors import UserError

    args = parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        overrides = ["algorithm=grpo", f"model.num_threads={args.threads}", *args.overrides]
        cfg = load_config(args.config, overrides)
        summary = run(cfg, args.run_dir)
    except (UserError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps({k: summary[k] for k in ("final_accuracy", "peak_rss_mb")}))
    if not args.no_result:
        result = {"seeds": [cfg.run.seed], "run_dir": str(args.run_dir), "summary": summary}
        print("->", write_result("trl_grpo", result, command_line(args), extra_versions=("trl",)))


if __name__ == "__main__":
    main()
