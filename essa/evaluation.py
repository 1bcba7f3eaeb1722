"""The held-out metric: what "held-out accuracy" means in a run (``evaluation.metric``).

Held-out scores are always a comparison with the reference answers, whatever reward trains:
a shaping reward (``format``) or a label-free one (``majority_vote``) can rise while answers get
worse, so it is never the held-out metric. Ungradable items count as wrong (score 0), as in
greedy pass@1. No torch here: this module sits between the config and the rewards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from essa.config import HELDOUT_METRICS, Config
from essa.errors import UserError
from essa.types import Example


def heldout_metric_name(cfg: Config) -> str:
    """``evaluation.metric``, or by default the training reward when it is a correctness
    metric (:data:`~essa.config.HELDOUT_METRICS`), else ``math_accuracy``.

    >>> from essa.config import load_config
    >>> heldout_metric_name(load_config(None, ["reward.name=format"]))
    'math_accuracy'
    >>> heldout_metric_name(load_config(None, ["reward.name=exact_match"]))
    'exact_match'
    """
    if cfg.evaluation.metric is not None:
        return cfg.evaluation.metric
    return cfg.reward.name if cfg.reward.name in HELDOUT_METRICS else "math_accuracy"


def heldout_metric(cfg: Config) -> tuple[str, Any]:
    """``(name, reward)`` of the held-out metric; the training reward's ``params`` go with it
    when the metric is the training reward (e.g. ``gym_score``'s task)."""
    from essa.rewards import get_reward

    name = heldout_metric_name(cfg)
    params = dict(cfg.reward.params) if name == cfg.reward.name else {}
    try:
        return name, get_reward(name, **params)
    except (ValueError, ImportError) as err:
        raise UserError(f"evaluation.metric: {err}") from None


def check_heldout_answers(name: str, examples: Sequence[Example]) -> None:
    """Refuse, before any model loads, held-out data without reference answers.

    ``gym_score`` grades with the task's own entries, found by prompt, so it needs no answers.
    """
    if name == "gym_score" or not examples or any(e.answer is not None for e in examples):
        return
    raise UserError(
        f"evaluation.metric: {name} compares with reference answers, but none of the "
        f"{len(examples)} held-out examples has one (check data.answer_field); a label-free "
        "reward can train, but held-out scores need answers"
    )


def score_heldout(
    reward: Any, completions: Sequence[str], examples: Sequence[Example], prompts: Sequence[str]
) -> tuple[float, list[float]]:
    """``(mean, per-item scores)`` of ``completions`` under the held-out metric ``reward``;
    None (ungradable) scores 0. NaN mean for no items."""
    raw = reward(list(completions), [e.answer for e in examples], list(prompts))
    scores = [0.0 if s is None else float(s) for s in raw]
    return (sum(scores) / len(scores) if scores else float("nan")), scores
