"""The reward contract: a batch callable, its error accounting, weighted sums and fitness.

A reward is called as ``reward(completions, answers, prompts) -> list[float | None]`` with three
equal-length lists; ``None`` means "cannot be graded" and is skipped by
:func:`fitness_from_rewards` (spec rewards-and-eval.md §1).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from numbers import Real

logger = logging.getLogger(__name__)

# The plain batch function a Reward wraps: (completions, answers, prompts) -> scores.
ScoreFn = Callable[[list[str], list[str | None], list[str]], list[float | None]]


@dataclass
class RewardStats:
    """Running counters of one reward since construction (or the last :meth:`reset`).

    - ``n_items``: items scored.
    - ``n_none``: items whose score is None (not gradable), errors included.
    - ``n_error``: items whose reward function raised or returned something unusable
      (their score is None).
    - ``n_timeout``: items whose verification timed out; they score 0.0, not None, so that a
      policy cannot gain from slow-to-verify output (spec §3.4).

    Thread-safe; read a consistent snapshot with :meth:`as_dict`.
    """

    n_items: int = 0
    n_none: int = 0
    n_error: int = 0
    n_timeout: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(
        self, *, n_items: int = 0, n_none: int = 0, n_error: int = 0, n_timeout: int = 0
    ) -> None:
        with self._lock:
            self.n_items += n_items
            self.n_none += n_none
            self.n_error += n_error
            self.n_timeout += n_timeout

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {
                "n_items": self.n_items,
                "n_none": self.n_none,
                "n_error": self.n_error,
                "n_timeout": self.n_timeout,
            }

    def reset(self) -> None:
        with self._lock:
            self.n_items = self.n_none = self.n_error = self.n_timeout = 0


def _as_score(value: object) -> float | None:
    """float for a finite real (bools included), None for None/NaN; ValueError otherwise."""
    if value is None:
        return None
    if not isinstance(value, Real):
        raise ValueError(f"reward value {value!r} is not a real number or None")
    score = float(value)
    if math.isnan(score):
        return None
    if math.isinf(score):
        raise ValueError(f"reward value {score} is not finite")
    return score


class Reward:
    """A named batch reward with error isolation and counters.

    Calling it scores each item. If the wrapped function raises, or returns a list of the wrong
    length or with a value that is not a real number or None, the batch is re-scored one item
    at a time; an item that still fails scores None and is counted in ``stats.n_error``
    (logged once per call). A reward never raises for bad items; it raises ValueError only when
    the three input lists differ in length.
    """

    def __init__(self, name: str, fn: ScoreFn, stats: RewardStats | None = None) -> None:
        self.name = name
        self.fn = fn
        self.stats = stats if stats is not None else RewardStats()

    def __repr__(self) -> str:
        return f"Reward({self.name!r})"

    def __call__(
        self, completions: list[str], answers: list[str | None], prompts: list[str]
    ) -> list[float | None]:
        if not len(completions) == len(answers) == len(prompts):
            raise ValueError(
                f"reward {self.name!r}: completions, answers and prompts differ in length "
                f"({len(completions)}, {len(answers)}, {len(prompts)})"
            )
        completions, answers, prompts = list(completions), list(answers), list(prompts)
        try:
            scores = self._checked(self.fn(completions, answers, prompts), len(completions))
        except Exception:
            scores = self._score_items(completions, answers, prompts)
        n_none = sum(score is None for score in scores)
        self.stats.add(n_items=len(scores), n_none=n_none)
        return scores

    @staticmethod
    def _checked(raw: object, n: int) -> list[float | None]:
        if not isinstance(raw, (list, tuple)) or len(raw) != n:
            raise ValueError(f"expected a list of {n} scores, got {type(raw).__name__}")
        return [_as_score(value) for value in raw]

    def _score_items(
        self, completions: list[str], answers: list[str | None], prompts: list[str]
    ) -> list[float | None]:
        scores: list[float | None] = []
        first_error: Exception | None = None
        for completion, answer, prompt in zip(completions, answers, prompts, strict=True):
            try:
                scores.append(self._checked(self.fn([completion], [answer], [prompt]), 1)[0])
            except Exception as error:
                scores.append(None)
                self.stats.add(n_error=1)
                first_error = first_error or error
        if first_error is not None:
            logger.warning(
                "reward %r failed on %d of %d items (scored None); first error: %r",
                self.name,
                sum(score is None for score in scores),
                len(scores),
                first_error,
            )
        return scores


def fitness_from_rewards(scores: Sequence[float | None]) -> float:
    """ESSA fitness of one candidate: mean of the non-None rewards, NaN if all are None.

    >>> fitness_from_rewards([1.0, None, 0.0])
    0.5
    >>> import math; math.isnan(fitness_from_rewards([None, None]))
    True
    """
    graded = [score for score in scores if score is not None]
    return math.fsum(graded) / len(graded) if graded else math.nan


def combine(parts: Sequence[tuple[Reward, float]], name: str | None = None) -> Reward:
    """Weighted sum ``R = sum_k w_k * R_k`` of rewards, e.g. ``0.9 * acc + 0.1 * format``.

    None handling: a part that scores None for an item contributes nothing to that item (the
    weights are *not* renormalised); the combined score is None only when every part is None.
    Each part keeps its own ``stats``; the combination has its own as well.

    >>> from essa.rewards import get_reward
    >>> both = combine([(get_reward("exact_match"), 0.9), (get_reward("format"), 0.1)])
    >>> both([r"\\boxed{4}", "4"], ["4", "4"], ["", ""])
    [0.1, 0.9]
    """
    if not parts:
        raise ValueError("combine needs at least one (reward, weight) pair")
    for reward, weight in parts:
        if not isinstance(reward, Reward):
            raise TypeError(f"combine expects Reward objects, got {type(reward).__name__}")
        if not math.isfinite(weight):
            raise ValueError(f"weight of {reward.name!r} is not finite: {weight}")

    def weighted_sum(
        completions: list[str], answers: list[str | None], prompts: list[str]
    ) -> list[float | None]:
        columns = [(reward(completions, answers, prompts), weight) for reward, weight in parts]
        totals: list[float | None] = []
        for i in range(len(completions)):
            terms = [(scores[i], weight) for scores, weight in columns]
            graded = [weight * score for score, weight in terms if score is not None]
            totals.append(math.fsum(graded) if graded else None)
        return totals

    label = name or " + ".join(f"{weight:g}*{reward.name}" for reward, weight in parts)
    return Reward(label, weighted_sum)
