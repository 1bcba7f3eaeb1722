"""The reference tie-breaker along the scaled line: does it rise where the reward does?

    python -m bench.studies.tie_breaker [--tasks number_format ...] [--root runs/bench-real-model]
                                [--seed 0] [--prompts 64]

For each task, the SFT adapter of a finished ``bench.studies.real_model`` run (``<root>/<task>/
essa-seed<seed>/sft_adapter``) is scaled uniformly (the scale baseline's line, s_B -> f s_B) and
each factor answers the same training prompts (drawn with a fixed generator; the held-out split
is never read), greedy, as a generation does. Per factor: the task's reward, the reference
tie-breaker's term (the reference answer's mean token log-likelihood, teacher-forced in the
generation's own prefill) and its margin form, and the share of items whose reference greedy
decoding writes token for token. Then the check the run makes (``reward.reference_check``,
essa.es.start.reference_check) on these factors: factors chosen on half the prompts by the
fitness with the tie-breaker and by the reward alone, scored by the reward on the other half.

Writes bench/results/tie_breaker.json and .md. About three minutes per task on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import write_result

FACTORS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)


def along_the_line(run_dir: Path, n_prompts: int) -> dict[str, Any]:
    """Reward, tie-breaker terms and the check for FACTORS on ``n_prompts`` training prompts."""
    from essa import setup
    from essa.adapters.svd import svd_adapter
    from essa.backends import population_evaluator
    from essa.backends.models import load_model
    from essa.config import load_config
    from essa.data.task import load_task, render_splits
    from essa.es.generation import prompt_values, reference_term, reference_terms
    from essa.es.start import preferred_factor, reference_check, scale_vector
    from essa.rewards.loading import es_reward_inputs, load_reward

    cfg = load_config(run_dir / "config.yaml")
    task = load_task(cfg.data, cfg.run.seed)
    model, tokenizer = load_model(cfg.model)
    cfg, _ = setup.resolve_lengths(cfg, tokenizer, task, lambda line: None)
    train_prompts, _ = render_splits(task, cfg.data, tokenizer)
    peft_model = setup.load_peft_adapter(model, str(run_dir / "sft_adapter"), "sft_adapter")
    adapter = svd_adapter(peft_model, cfg.adapter.alpha)
    base = peft_model.unload()
    evaluator = population_evaluator(setup.evaluator_settings(cfg), base, tokenizer, adapter, 1)
    inputs = es_reward_inputs(cfg.reward, cfg.generation, cfg.backend)
    reward = load_reward(cfg.reward, recipe="ESSA", **inputs)
    idx = np.random.default_rng(0).choice(len(task.train), n_prompts, replace=False)
    prompts = [train_prompts[i] for i in idx]
    answers = [task.train[i].answer for i in idx]
    population = np.stack([scale_vector(adapter, f) for f in FACTORS])  # (F, D)
    terms: dict[str, np.ndarray] = {}
    for signal in ("likelihood", "margin"):
        evaluator.reference_margin = signal == "margin"  # type: ignore[attr-defined]
        texts = evaluator.completions(population, prompts, seed=0, references=answers)
        logprobs = evaluator.last_reference_logprobs  # type: ignore[attr-defined]
        terms[signal] = reference_term(logprobs)  # (F,)
        if signal == "likelihood":
            terms["per_prompt"] = reference_terms(logprobs, n_prompts)  # (F, N)
        if signal == "margin":  # 0 at every position: greedy writes the reference
            terms["written"] = np.array(
                [np.mean([bool(t) and min(t) > -1e-9 for t in items]) for items in logprobs]
            )
    graded = [reward(t, answers, prompts) for t in texts]
    per_prompt = prompt_values(graded, len(prompts), 1, np.zeros(len(FACTORS), bool))  # (F, N)
    fitness = np.nanmean(per_prompt, axis=1)
    weight = cfg.reward.reference_weight
    check = reference_check(per_prompt, terms["per_prompt"], weight, FACTORS)
    return {
        "run_dir": str(run_dir),
        "prompts": n_prompts,
        "factors": list(FACTORS),
        "reward": fitness.round(4).tolist(),
        "likelihood": terms["likelihood"].round(4).tolist(),
        "margin": terms["margin"].round(4).tolist(),
        "reference_written": terms["written"].round(4).tolist(),
        "reward_choice": FACTORS[preferred_factor(fitness, FACTORS)],
        "check": check,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| task | per factor x0.25 ... x2: reward / likelihood / margin / reference written | "
        "reward's factor | fitness's factor | other half: with / without | tie-breaker |",
        "|---|---|---|---|---|---|",
    ]
    for task, r in result["tasks"].items():
        cells = "<br>".join(
            f"x{f:g}: {a:.3f} / {lk:.2f} / {m:.2f} / {w:.2f}"
            for f, a, lk, m, w in zip(
                r["factors"],
                r["reward"],
                r["likelihood"],
                r["margin"],
                r["reference_written"],
                strict=True,
            )
        )
        c = r["check"]
        verdict = "kept" if c["agrees"] else "off"
        lines.append(
            f"| {task} | {cells} | x{r['reward_choice']:g} | x{c['factor']:g} | "
            f"{c['reward_with']:.3f} / {c['reward_without']:.3f} | {verdict} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tasks", nargs="+",
        default=["chain_sum", "number_format", "word_sorting", "fraction_simplification"],
    )  # fmt: skip
    parser.add_argument("--root", default="runs/bench-real-model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=64)
    args = parser.parse_args()
    runs = {t: Path(args.root) / t / f"essa-seed{args.seed}" for t in args.tasks}
    missing = [str(d) for d in runs.values() if not (d / "sft_adapter").is_dir()]
    if missing:
        raise SystemExit(f"bench.studies.tie_breaker: no SFT adapter in {', '.join(missing)} "
                         "(run bench.studies.real_model for these tasks first)")  # fmt: skip
    result = {"tasks": {}}
    for task, run_dir in runs.items():
        print(f"[tie_breaker] {task} ...", flush=True)
        result["tasks"][task] = along_the_line(run_dir, args.prompts)
    md = table(result)
    print(md)
    write_result(
        "tie_breaker", result, " ".join(["python -m bench.studies.tie_breaker", *sys.argv[1:]])
    )
    Path("bench/results/tie_breaker.md").write_text(md + "\n")


if __name__ == "__main__":
    main()
