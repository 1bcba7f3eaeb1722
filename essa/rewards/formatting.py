"""Format, string-match and length rewards (spec rewards-and-eval.md §5, grpo-family.md §5).

Lengths are tokenizer-free by default: ``unit="words"`` counts whitespace-separated words,
``unit="chars"`` counts characters. Pass ``length_fn`` (e.g. ``lambda s: len(tok.encode(s))``)
to measure in tokens; the thresholds are in the same unit as the measure.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from essa.rewards.accuracy import MathVerifier, count_grades
from essa.rewards.base import RewardStats, ScoreFn
from essa.rewards.extract import last_boxed

# TRL think_format_reward: one <think>...</think> block opening the completion.
THINK_PATTERN = r"^<think>(?!.*<think>)(.*?)</think>.*$"


def length_measure(
    unit: str = "words", length_fn: Callable[[str], int] | None = None
) -> Callable[[str], int]:
    """The completion-length function: ``length_fn`` if given, else words or characters."""
    if length_fn is not None:
        return length_fn
    if unit == "words":
        return lambda text: len(text.split())
    if unit == "chars":
        return len
    raise ValueError(f"unknown length unit {unit!r}; known: 'words', 'chars'")


def format_reward(
    stats: RewardStats,
    *,
    use_boxed: bool = True,
    use_think_tags: bool = False,
    pattern: str | None = None,
) -> ScoreFn:
    """1.0 if every enabled format check passes, else 0.0; never None (needs no answer).

    Checks: ``use_boxed`` - a non-empty ``\\boxed{}`` can be extracted (Spurious-Rewards
    ``box_only_format``); ``use_think_tags`` - ``re.match(THINK_PATTERN, y, DOTALL | MULTILINE)``
    (TRL ``think_format_reward``); ``pattern`` - ``re.match(pattern, y, DOTALL | MULTILINE)``.

    >>> from essa.rewards import get_reward
    >>> get_reward("format")([r"so \\boxed{2}", "so 2", r"\\boxed{}"], [None] * 3, [""] * 3)
    [1.0, 0.0, 0.0]
    """
    checks: list[re.Pattern[str]] = []
    if use_think_tags:
        checks.append(re.compile(THINK_PATTERN, re.DOTALL | re.MULTILINE))
    if pattern is not None:
        checks.append(re.compile(pattern, re.DOTALL | re.MULTILINE))
    if not use_boxed and not checks:
        raise ValueError("format reward: enable use_boxed, use_think_tags or give a pattern")

    def is_formatted(text: str) -> bool:
        if use_boxed and not (last_boxed(text) or "").strip():
            return False
        return all(check.match(text) for check in checks)

    def score(
        completions: list[str], answers: list[str | None], prompts: list[str]
    ) -> list[float | None]:
        return [float(is_formatted(text)) for text in completions]

    return score


def exact_match(stats: RewardStats) -> ScoreFn:
    """1.0 if ``completion.strip() == answer.strip()``, else 0.0; None when the answer is None.

    For toy tasks whose completion is the bare answer (e.g. the built-in arithmetic task).

    >>> from essa.rewards import get_reward
    >>> get_reward("exact_match")([" 46\\n", "46.0", "x"], ["46", "46", None], [""] * 3)
    [1.0, 0.0, None]
    """

    def score(
        completions: list[str], answers: list[str | None], prompts: list[str]
    ) -> list[float | None]:
        return [
            None if answer is None else float(text.strip() == answer.strip())
            for text, answer in zip(completions, answers, strict=True)
        ]

    return score


def soft_overlong_penalty(length: float, max_length: float, cache_length: float) -> float:
    """DAPO eq. 13: 0 if ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) / L_cache``
    if ``L_max - L_cache < |y| <= L_max``; -1 if ``|y| > L_max``.

    >>> soft_overlong_penalty(18432, 20480, 4096)
    -0.5
    >>> soft_overlong_penalty(16000, 20480, 4096)
    0.0
    """
    expected = max_length - cache_length
    if length <= expected:
        return 0.0
    if length <= max_length:
        return (expected - length) / cache_length
    return -1.0


def overlong(
    stats: RewardStats,
    *,
    max_length: int = 20480,
    cache_length: int = 4096,
    unit: str = "words",
    length_fn: Callable[[str], int] | None = None,
) -> ScoreFn:
    """DAPO soft overlong punishment (eq. 13), meant to be *added* to a correctness reward.

    ``R = 0`` up to ``L_max - L_cache``, then linear down to -1 at ``L_max``, and -1 beyond
    (see :func:`soft_overlong_penalty`). Defaults are DAPO's (20480, 4096), here in words
    unless ``length_fn`` measures tokens. Never None.

    >>> from essa.rewards import get_reward
    >>> get_reward("overlong", max_length=10, cache_length=4)(["a " * 6, "a " * 8, "a " * 12], [None] * 3, [""] * 3)
    [0.0, -0.5, -1.0]
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(f"need 0 < cache_length <= max_length, got {cache_length}, {max_length}")
    measure = length_measure(unit, length_fn)

    def score(
        completions: list[str], answers: list[str | None], prompts: list[str]
    ) -> list[float | None]:
        return [
            soft_overlong_penalty(measure(text), max_length, cache_length) for text in completions
        ]

    return score


def cosine_length_value(length: float, max_length: float, v_min: float, v_max: float) -> float:
    """``R = v_min + 1/2 (v_max - v_min)(1 + cos(pi * min(|y| / L, 1)))``: v_max at length 0,
    v_min at length L and beyond.

    >>> cosine_length_value(0, 100, 0.5, 1.0), cosine_length_value(50, 100, 0.5, 1.0)
    (1.0, 0.75)
    """
    ratio = min(length / max_length, 1.0)
    return v_min + 0.5 * (v_max - v_min) * (1.0 + math.cos(math.pi * ratio))


def length(
    stats: RewardStats,
    *,
    max_length: int = 1000,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
    min_value_wrong: float = -0.5,
    max_value_wrong: float = -1.0,
    unit: str = "words",
    length_fn: Callable[[str], int] | None = None,
    timeout_seconds: int = 5,
) -> ScoreFn:
    """Cosine-scaled length reward (TRL ``get_cosine_scaled_reward``; spec §5).

    ``R = v_min + 1/2 (v_max - v_min)(1 + cos(pi * min(|y| / L, 1)))`` with
    ``(v_min, v_max) = (0.5, 1.0)`` if the answer is correct (as in ``math_accuracy``) and
    ``(-0.5, -1.0)`` if wrong: short correct answers score 1.0, short wrong ones -1.0, and
    length pulls both towards +-0.5. None when the gold is None or does not parse; a
    verification timeout counts as wrong.

    >>> from essa.rewards import get_reward
    >>> get_reward("length", max_length=4)([r"so \\boxed{1}", r"so \\boxed{2}"], ["1", "1"], ["", ""])
    [0.75, -0.75]
    """
    if max_length <= 0:
        raise ValueError(f"max_length must be positive, got {max_length}")
    measure = length_measure(unit, length_fn)
    verifier = MathVerifier(timeout_seconds=timeout_seconds)

    def score(
        completions: list[str], answers: list[str | None], prompts: list[str]
    ) -> list[float | None]:
        grades = verifier.grade(completions, answers)
        count_grades(stats, grades)
        scores: list[float | None] = []
        for text, grade in zip(completions, grades, strict=True):
            if grade.correct is None:
                scores.append(None)
            elif grade.correct:
                scores.append(
                    cosine_length_value(
                        measure(text), max_length, min_value_correct, max_value_correct
                    )
                )
            else:
                scores.append(
                    cosine_length_value(measure(text), max_length, min_value_wrong, max_value_wrong)
                )
        return scores

    return score
