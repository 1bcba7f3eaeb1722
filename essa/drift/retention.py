"""Retention and diversity: greedy accuracy on a task the run does not train on (built-in or
reasoning-gym) for the base, SFT and tuned models, and on a task of few answers their forced
choice between them; pass@K, maj@K, mean@K and the answer
entropy of K sampled completions per held-out item. Sampling draws from counter-based per-row
streams (``drift.samples``), never from a stream training uses."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

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
    micro_batch_size: int = 8,
) -> dict[str, Any]:
    """Greedy accuracy of each model on ``examples`` (the share ``reward`` gives full credit)
    and the tuned one's changes; on a task of few answers, also ``choice``
    (:func:`forced_choice`). ``cache``: the base's and the SFT adapter's answers and choice
    scores, written before the search (:func:`fixed_answers`, :func:`fixed_choices`)."""
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
    choice = forced_choice(models, examples, prompts, micro_batch_size, cache)
    if choice is not None:
        report["choice"] = choice
    return report


CHOICE_LABELS = 4  # a task with at most this many distinct answers is also read by forced choice


def choice_labels(
    examples: Sequence[Example], tokenizer: Any
) -> tuple[list[str], list[int]] | None:
    """The task's distinct answers, sorted (True/False: two), and each one's first token id,
    when it has 2 to :data:`CHOICE_LABELS` of them whose first tokens differ; else None.

    >>> class Chars:  # a tokenizer of one id per character
    ...     def __call__(self, texts, add_special_tokens=False):
    ...         return {"input_ids": [[ord(c) for c in t] for t in texts]}
    >>> yes_no = [Example("p", "True"), Example("q", "False"), Example("r", "True")]
    >>> choice_labels(yes_no, Chars())
    (['False', 'True'], [70, 84])
    >>> choice_labels([Example("p", "12"), Example("q", "17")], Chars()) is None  # first: "1"
    True
    """
    answers = sorted({str(e.answer) for e in examples})
    if not 2 <= len(answers) <= CHOICE_LABELS:
        return None
    ids = tokenizer(answers, add_special_tokens=False)["input_ids"]
    if any(not i for i in ids) or len({i[0] for i in ids}) < len(ids):
        return None
    return answers, [int(i[0]) for i in ids]


def forced_choice(
    models: Models,
    examples: Sequence[Example],
    prompts: Sequence[str],
    micro_batch_size: int,
    cache: ContinuationCache | None = None,
) -> dict[str, Any] | None:
    """Forced-choice accuracy of each model on a task of few answers (:func:`choice_labels`):
    the share of items whose reference is the answer whose first token the model ranks
    highest right after the prompt, ``logp``, the mean log-probability of the reference's
    first token there, and ``auc``, how well those log-probs tell the items apart whatever
    label the model leans to (:func:`ranking_auc`). None for a task of many answers.

    Greedy retention reads the format and the label a model leans to as well as what it
    knows: an SFT adapter that answers every True/False item with one label scores that
    label's share whatever its likelihoods still rank (docs/drift.md). Forced choice reads the
    ranking. One teacher-forced forward per model; the base's and the SFT adapter's scores from
    ``cache`` when written before the search (:func:`essa.drift.report.warm`)."""
    labels = choice_labels(examples, models.tokenizer)
    if labels is None:
        return None
    answers, firsts = labels
    scores = _cached_choices(models, prompts, firsts, micro_batch_size, cache)
    for name in (n for n in models.names if n not in scores):
        scores[name] = choice_scores(models, prompts, firsts, name, micro_batch_size)
    truth = np.array([answers.index(str(e.answer)) for e in examples])  # (N,)
    report: dict[str, Any] = {"labels": answers}
    for name, rows in scores.items():
        logp = np.asarray(rows, dtype=np.float64)  # (N, L)
        report[name] = float(np.mean(logp.argmax(1) == truth))
        report[f"logp_{name}"] = float(np.mean(logp[np.arange(len(truth)), truth]))
        report[f"auc_{name}"] = ranking_auc(logp, truth)
    for name in FIXED_MODELS:
        if name in report and "tuned" in report:
            report[f"change_from_{name}"] = report["tuned"] - report[name]
            report[f"auc_change_from_{name}"] = report["auc_tuned"] - report[f"auc_{name}"]
    return report


def ranking_auc(logp: np.ndarray, truth: np.ndarray) -> float:
    """How well a model's answer log-probs ``logp`` (N, L) tell the items apart, whatever label
    it leans to: per label k, the area under the ROC curve of the score log p_k - mean of the
    other labels' log p over the items whose answer is k against the rest (ties count half),
    averaged over the labels. 0.5 is chance; a model that shifts every item toward one label
    keeps its AUC where its accuracy falls to that label's share.

    >>> truth = np.array([0, 0, 1, 1])
    >>> leaning = np.log([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4]])  # says 0 on all
    >>> float(np.mean(leaning.argmax(1) == truth)), round(ranking_auc(leaning, truth), 3)
    (0.5, 1.0)
    >>> round(ranking_auc(leaning[::-1], truth), 3)  # ranked the wrong way round
    0.0
    """
    aucs = []
    for k in range(logp.shape[1]):
        score = logp[:, k] - np.delete(logp, k, axis=1).mean(axis=1)  # (N,)
        pos, neg = score[truth == k, None], score[None, truth != k]  # (P, 1), (1, Q)
        if pos.size and neg.size:
            aucs.append(float((pos > neg).mean() + 0.5 * (pos == neg).mean()))
    return float(np.mean(aucs)) if aucs else float("nan")


@torch.no_grad()
def choice_scores(
    models: Models, prompts: Sequence[str], firsts: Sequence[int], name: str, micro_batch_size: int
) -> list[list[float]]:
    """(N, L) per prompt, model ``name``'s log-probability of each label's first token
    ``firsts`` (L,) as the first token after the prompt. Each model runs in forwards of its
    own, so a score does not depend on which other models were scored with it."""
    ids = models.tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    pairs = [(list(p), [firsts[0]]) for p in ids]  # one scored column: the answer's first
    columns = torch.tensor(list(firsts))  # (L,)
    out: list[list[float]] = []
    for start in range(0, len(pairs), micro_batch_size):
        chunk = pairs[start : start + micro_batch_size]
        logp = models.log_softmax(chunk, (name,))[name]  # (B, 2, V): column 0 predicts it
        out.extend(logp[:, 0, columns].tolist())
    return out


def fixed_choices(
    models: Models,
    examples: Sequence[Example],
    prompts: Sequence[str],
    micro_batch_size: int,
    cache: ContinuationCache | None,
) -> dict[str, list[list[float]]]:
    """The base's and the SFT adapter's :func:`choice_scores`, from ``cache`` or made into it;
    {} without a cache or on a task of many answers."""
    labels = choice_labels(examples, models.tokenizer)
    if labels is None:
        return {}
    return _cached_choices(models, prompts, labels[1], micro_batch_size, cache)


def _cached_choices(
    models: Models,
    prompts: Sequence[str],
    firsts: Sequence[int],
    micro_batch_size: int,
    cache: ContinuationCache | None,
) -> dict[str, list[list[float]]]:
    if cache is None:
        return {}
    fixed = [n for n in models.names if n in FIXED_MODELS]

    def make(names: Sequence[str]) -> dict[str, list[list[float]]]:
        return {n: choice_scores(models, prompts, firsts, n, micro_batch_size) for n in names}

    key = ("choice", tuple(prompts), tuple(firsts))
    return cache.fixed_texts(models, key, fixed, make)


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
