"""Retention and diversity: greedy accuracy on a task the run does not train on (built-in or
reasoning-gym) for the base, SFT and tuned models; pass@K, maj@K, mean@K and the answer
entropy of K sampled completions per held-out item. Sampling draws from counter-based per-row
streams (``drift.samples``), never from a stream training uses."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from essa import seeding
from essa.config import DataConfig, DriftConfig, GenerationConfig
from essa.drift.models import Models
from essa.drift.offtask import ContinuationCache
from essa.types import Example

FIXED_MODELS = ("base", "sft")  # what the search does not move


def retention_source(d: DriftConfig, data: DataConfig) -> str | None:
    """The task retention is measured on (None: off): ``builtin:NAME`` or ``reasoning_gym:TASK``;
    of a list, the first task that is not the training task (the config refuses a list of only
    that one).

    >>> retention_source(DriftConfig(), DataConfig(source="builtin:arithmetic"))
    'builtin:arithmetic_mixed'
    >>> listed = DriftConfig(retention=("builtin:arithmetic", "builtin:arithmetic3"))
    >>> retention_source(listed, DataConfig(source="builtin:arithmetic"))
    'builtin:arithmetic3'
    """
    if d.retention == "none" or d.items == 0:
        return None
    if d.retention == "auto":
        mixed = "builtin:arithmetic_mixed"
        return "builtin:arithmetic" if data.source == mixed else mixed
    if isinstance(d.retention, tuple):
        return next(task for task in d.retention if task != data.source)
    return d.retention


def retention_length(d: DriftConfig, gen: GenerationConfig) -> int:
    """New tokens retention generates: the run's length, or ``d.retention_tokens`` when
    longer. The retention task is not the run's: the base model, in a chat template, writes a
    sentence before its number, and at a short task's length (6 tokens on chain_sum) every such
    answer was cut and scored 0.

    >>> retention_length(DriftConfig(), GenerationConfig(max_new_tokens=6))
    32
    """
    return max(gen.new_tokens, d.retention_tokens)


def retention_task(source: str, items: int) -> tuple[list[Example], Any]:
    """The first ``items`` held-out examples of ``source`` and the reward that grades them: the
    task's own scorer for ``reasoning_gym:TASK`` (at its default parameters), math accuracy for
    a built-in task."""
    from essa.data.gym import GYM_PREFIX
    from essa.data.loaders import load_examples
    from essa.rewards import get_reward

    examples = load_examples(source, split="test", limit=items)
    if source.startswith(GYM_PREFIX):
        return examples, get_reward("gym_score", task=source.removeprefix(GYM_PREFIX))
    return examples, get_reward("math_accuracy")


def retention(
    models: Models,
    examples: Sequence[Example],
    prompts: Sequence[str],
    gen: GenerationConfig,
    source: str,
    reward: Any,
    cache: ContinuationCache | None = None,
) -> dict[str, Any]:
    """Greedy accuracy of each model on ``examples`` (the share ``reward`` gives full credit)
    and the tuned one's changes. ``cache``: the base's and the SFT adapter's answers, written
    before the search (:func:`fixed_answers`)."""
    answers = [e.answer for e in examples]
    texts = dict(fixed_answers(models, prompts, gen, cache))
    tuned = [n for n in models.names if n not in texts]
    if tuned:
        texts.update(models.generate(prompts, replace(gen, temperature=0.0), tuned, tools=True))
    report: dict[str, Any] = {"source": source, "items": len(examples)}
    for name, completions in texts.items():
        scores = reward(completions, answers, list(prompts))
        report[name] = sum(float(s or 0.0) >= 1.0 for s in scores) / len(scores)
    for name in ("base", "sft"):
        if name in report:
            report[f"change_from_{name}"] = report["tuned"] - report[name]
    return report


def fixed_answers(
    models: Models,
    prompts: Sequence[str],
    gen: GenerationConfig,
    cache: ContinuationCache | None,
) -> dict[str, list[str]]:
    """Retention's greedy answers of the models the run does not train (base, SFT adapter),
    from ``cache`` or generated into it; {} without a cache."""
    if cache is None:
        return {}
    fixed = [n for n in models.names if n in FIXED_MODELS]
    greedy = replace(gen, temperature=0.0)

    def make(names: Sequence[str]) -> dict[str, list[str]]:
        return models.generate(prompts, greedy, names, tools=True)

    key = ("retention", tuple(prompts), greedy.new_tokens, repr(models.tools))
    return cache.fixed_texts(models, key, fixed, make)


def sampled(
    models: Models,
    examples: Sequence[Example],
    prompts: Sequence[str],
    gen: GenerationConfig,
    k: int,
    reward: Any,
    seed: int,
) -> dict[str, Any]:
    """pass@K, maj@K, mean@K and the mean answer entropy (nats) of the tuned model from K
    samples per item, on per-row streams of ``drift.samples`` (no training stream moves)."""
    from essa.backends.sampling import row_seed

    base_seed = seeding.seed_int(seed, "drift.samples")
    rows = [p for p in prompts for _ in range(k)]  # problem-major
    seeds = [row_seed(base_seed, i, j) for i in range(len(prompts)) for j in range(k)]
    texts = models.generate(rows, gen, ["tuned"], row_seeds=seeds, tools=True)["tuned"]
    answers = [e.answer for e in examples for _ in range(k)]
    return grade_samples(texts, answers, rows, k, reward)


def grade_samples(
    texts: Sequence[str], answers: Sequence[str | None], rows: Sequence[str], k: int, reward: Any
) -> dict[str, Any]:
    """The sampled metrics of ``texts`` (problem-major, ``k`` per problem); full credit only."""
    from essa.metrics import sample_metrics
    from essa.rewards import extract_answer

    values = [float(s or 0.0) for s in reward(list(texts), list(answers), list(rows))]
    n = len(values) // k
    correct = [[v >= 1.0 for v in values[i * k : (i + 1) * k]] for i in range(n)]
    keys = [[extract_answer(t) for t in texts[i * k : (i + 1) * k]] for i in range(n)]
    metrics: dict[str, Any] = {"k": k, "items": n}
    metrics.update(sample_metrics(correct, ks=sorted({1, k}), keys=keys))
    metrics[f"mean@{k}"] = metrics.pop(f"avg@{k}")
    metrics["answer_entropy"] = float(np.mean([answer_entropy(row) for row in keys]))
    return metrics


def answer_entropy(answers: Sequence[str | None]) -> float:
    """Entropy (nats) of the extracted answers of one problem's samples (None is an answer).

    >>> answer_entropy(["1", "1"]), round(answer_entropy(["1", "2"]), 4)
    (0.0, 0.6931)
    """
    counts = np.array(list(Counter(answers).values()), dtype=np.float64)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum()) + 0.0  # + 0.0: one answer is 0.0, not -0.0
