"""Which tasks can retention measure forgetting on: the base model's score on candidates.

    OMP_NUM_THREADS=1 python -m bench.studies.retention_tasks [--config configs/smollm2.yaml]
        [--sft-adapter RUN/sft_adapter] [--items 128] [--tasks builtin:arithmetic ...] [--out NAME]

(an SFT adapter of the shipped config: ``essa sft configs/smollm2.yaml --run-dir RUN``, chain_sum)

Retention (evaluation.drift.retention, docs/drift.md) is greedy accuracy on a task the run
does not train on; a task the base model scores 0 on cannot show forgetting. Each candidate is
scored on the path retention takes (essa.drift.retention's retention_task and retention): the
first ``--items`` of its held-out split in the config's template, with its tool calls, up to
max(retention_tokens, the run's length) new tokens, full credit only; by the base model and,
with ``--sft-adapter``, by that adapter too. Per task also the share of the commonest reference
answer (what always giving it scores) and the references' length in tokens, to set against the
generated length.

Writes bench/results/<--out>.json and .md (default retention_tasks). On 2 busy cores about three
minutes per task for the base model and an SFT adapter.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import RESULTS, write_result

# The built-in levels the demo's auto choice takes, and reasoning-gym tasks at their default
# parameters whose answers a 135M chat model might give in a few words: True/False and Yes/No
# tasks, one word, a list of words, a number. None is a training task of configs/smollm2*.yaml
# or of the real-model and tools studies. A 16-item screen of 15 more (aiw, needle_haystack,
# largest_island, self_reference, binary_alternation, ...; docs/drift.md) found no full credit
# but on game_of_life_halting, whose scorer takes bool() of the answer text.
CANDIDATES = (
    "builtin:arithmetic",
    "builtin:arithmetic_mixed",
    "reasoning_gym:course_schedule",
    "reasoning_gym:ransom_note",
    "reasoning_gym:isomorphic_strings",
    "reasoning_gym:syllogism",
    "reasoning_gym:family_relationships",
    "reasoning_gym:word_sequence_reversal",
)


def measure(config: Path, sft_adapter: Path | None, items: int, tasks: list[str]) -> dict:
    """Each task's retention scores (base, and sft with an adapter) and answer lengths."""
    from dataclasses import replace

    from essa import setup
    from essa.backends.models import load_model
    from essa.config import load_config
    from essa.data.task import load_task, render_prompts
    from essa.drift.models import PeftModels
    from essa.drift.retention import retention, retention_length, retention_task

    cfg = load_config(config)
    model, tokenizer = load_model(cfg.model)
    cfg, _ = setup.resolve_lengths(cfg, tokenizer, load_task(cfg.data, cfg.run.seed), print)
    gen = replace(
        cfg.generation, max_new_tokens=retention_length(cfg.evaluation.drift, cfg.generation)
    )
    if sft_adapter is not None:
        model = setup.load_peft_adapter(model, str(sft_adapter), "sft_adapter")
    # With an adapter "tuned" is the adapter and "base" the model without it; without one the
    # bare model is the only model, named "tuned".
    mb, adapter = cfg.evaluation.micro_batch_size, sft_adapter is not None
    models = PeftModels(model, tokenizer, mb, has_base=adapter, tools=cfg.tools.calls)
    names = {"base": "base", "tuned": "sft"} if adapter else {"tuned": "base"}
    out: dict[str, Any] = {}
    for source in tasks:
        examples, grader = retention_task(source, items)
        prompts = render_prompts(examples, cfg.data.template, tokenizer, cfg.data.system_prompt)
        report = retention(models, examples, prompts, gen, source, grader)
        answers = [e.answer or "" for e in examples]
        lengths = [len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers]
        out[source] = {
            "items": report["items"],
            **{ours: round(report[theirs], 4) for theirs, ours in names.items()},
            # what always giving the commonest reference answer scores (True/False tasks)
            "majority": round(max(Counter(answers).values()) / len(answers), 4),
            "answer_tokens_max": max(lengths),
            "answer_tokens_mean": round(sum(lengths) / len(lengths), 1),
        }
        print(source, out[source], flush=True)
    return {"tokens": gen.max_new_tokens, "template": cfg.data.template, "tasks": out}


def table(result: dict[str, Any]) -> str:
    with_sft = any("sft" in r for r in result["tasks"].values())
    head = "| task | items | base |" + (" SFT |" if with_sft else "")
    head += " commonest answer's share | answer tokens max / mean |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for task, r in sorted(result["tasks"].items(), key=lambda kv: -kv[1]["base"]):
        sft = f" {r['sft']:.3f} |" if with_sft else ""
        lines.append(
            f"| {task} | {r['items']} | {r['base']:.3f} |{sft} {r['majority']:.3f} | "
            f"{r['answer_tokens_max']} / {r['answer_tokens_mean']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/smollm2.yaml"))
    parser.add_argument("--sft-adapter", type=Path, default=None)
    parser.add_argument("--items", type=int, default=128)
    parser.add_argument("--tasks", nargs="+", default=list(CANDIDATES))
    parser.add_argument("--out", default="retention_tasks")
    args = parser.parse_args()
    result = {"config": str(args.config), "sft_adapter": str(args.sft_adapter or "")}
    result.update(measure(args.config, args.sft_adapter, args.items, args.tasks))
    write_result(
        args.out, result, "python -m bench.studies.retention_tasks " + " ".join(sys.argv[1:])
    )
    (RESULTS / f"{args.out}.md").write_text(table(result) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
