"""Spurious-reward baselines (spec rewards-and-eval.md §6, "Spurious Rewards", arXiv 2506.10947).

Project rule: every reported improvement on a Qwen-family model comes with a ``random``
(p = 0.5) run and a ``format``-only run under the same method and budget.
"""

from __future__ import annotations

from essa import seeding
from essa.rewards.accuracy import MathVerifier, count_grades
from essa.rewards.base import DrawKey, KeyedScoreFn, RewardStats, ScoreFn, check_seed


def random_reward(stats: RewardStats, *, p: float = 0.5, seed: int = 0) -> KeyedScoreFn:
    """``R ~ Bernoulli(p)``, independent of the output (the paper's ``random0.5`` with p = 0.5).

    Deterministic: item i's draw is taken at its draw key in the ``reward.random`` stream of
    ``seed`` (:mod:`essa.rewards.base`, :mod:`essa.seeding`), so it depends on where the item
    sits in the run, not on the order of calls. Never None.

    >>> from essa.rewards import get_reward
    >>> get_reward("random", p=1.0)(["a", "b"], [None, None], ["", ""])
    [1.0, 1.0]
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    check_seed(seed)

    def score(
        completions: list[str], answers: list[str | None], prompts: list[str], keys: list[DrawKey]
    ) -> list[float | None]:
        return [float(seeding.rng(seed, "reward.random", *key).random() < p) for key in keys]

    return score


def incorrect_label(
    stats: RewardStats, *, timeout_seconds: int = 5, use_last_number: bool = True
) -> ScoreFn:
    """Rewards a *wrong* answer: 1.0 if an answer is extracted and is not equivalent to the
    gold, 0.0 if it is equivalent, if none is extracted or if verification timed out.

    ``R = 1[answer extracted] * (1 - math_accuracy)``; None when the gold is None or does not
    parse. Extraction is that of ``math_accuracy`` (``use_last_number`` included). The paper's setting (train on fixed wrong majority-vote labels) is instead
    ``math_accuracy`` with the data's answer field pointing at the wrong labels.

    >>> from essa.rewards import get_reward
    >>> get_reward("incorrect_label")([r"\\boxed{3}", r"\\boxed{4}", "none"], ["4"] * 3, [""] * 3)
    [1.0, 0.0, 0.0]
    """
    verifier = MathVerifier(timeout_seconds=timeout_seconds, use_last_number=use_last_number)

    def score(
        completions: list[str], answers: list[str | None], prompts: list[str]
    ) -> list[float | None]:
        grades = verifier.grade(completions, answers)
        count_grades(stats, grades)
        return [
            None if grade.correct is None else float(grade.status == "ok" and not grade.correct)
            for grade in grades
        ]

    return score
