"""Rewards computed from token log-probabilities: ``self_confidence`` and ``reference_logprob``.

These are not text rewards: they need log-probabilities from the model being evaluated, which
only the backend has. The hook is one method, :class:`LogprobScorer`:

    token_logprobs(prompts, continuations) -> list[list[float]]

the teacher-forced log-probability of every token of each continuation given its prompt,
``log pi(y_t | x, y_<t)``, under the model as it is *now* (for ES: the candidate currently set
on the backend). A backend implements it with one forward pass over ``prompt + continuation``,
tokenising the prompt and the continuation separately and concatenating the ids, so that the
scored tokens are exactly the continuation's (shift the logits by one, gather, keep the
continuation positions). vLLM users can take the sampled tokens' log-probs from generation
instead (``SamplingParams(logprobs=0)``) and pass them directly, see below.

A backend supplies the log-probs in one of two ways:

1. **Bound scorer**: ``get_reward("self_confidence", scorer=backend)`` (or set
   ``reward.scorer = backend`` later); the reward is then a plain 3-list reward that calls
   ``backend.token_logprobs`` itself. This is the only way that works inside ``combine`` and
   ``noisy``.
2. **Per call**: ``reward.score_with_logprobs(completions, answers, prompts, logprobs)`` with
   precomputed ``logprobs[i]``; which sequence they belong to is named by ``reward.needs``:
   ``{"completion_logprobs"}`` -> ``completions[i]``; ``{"reference_logprobs"}`` -> the
   reference ``answers[i]`` (None where the answer is None).

Calling a log-probability reward with the three lists and no scorer bound raises
:class:`MissingInputError` (a configuration error, not a bad item).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from essa.rewards.base import Reward, RewardStats

# (completions, answers, prompts, logprobs) -> scores; logprobs[i] is None or a token list.
LogprobScoreFn = Callable[
    [list[str], list[str | None], list[str], list[Sequence[float] | None]],
    list[float | None],
]

COMPLETION_LOGPROBS = "completion_logprobs"
REFERENCE_LOGPROBS = "reference_logprobs"


@runtime_checkable
class LogprobScorer(Protocol):
    """The backend hook of the log-probability rewards (see the module docstring)."""

    def token_logprobs(self, prompts: list[str], continuations: list[str]) -> list[list[float]]:
        """``[[log pi(y_t | x, y_<t) for t in range(len(y))] for (x, y) in pairs]``, teacher-
        forced under the model being evaluated; an empty continuation gives ``[]``."""
        ...


class MissingInputError(ValueError):
    """A log-probability reward was called without its log-probs (no scorer bound)."""


class LogprobReward(Reward):
    """A reward whose score function also takes per-item token log-probs.

    ``needs`` is ``{"completion_logprobs"}`` (scored sequence = the completion) or
    ``{"reference_logprobs"}`` (scored sequence = the reference in ``answers``). Error isolation
    and counters are those of :class:`~essa.rewards.base.Reward`.
    """

    def __init__(
        self,
        name: str,
        fn: LogprobScoreFn,
        stats: RewardStats | None = None,
        *,
        target: str,
        scorer: LogprobScorer | None = None,
    ) -> None:
        if target not in (COMPLETION_LOGPROBS, REFERENCE_LOGPROBS):
            raise ValueError(f"unknown log-prob target {target!r}")
        super().__init__(name, fn, stats)  # type: ignore[arg-type]
        self.needs = frozenset({target})
        self.scorer = scorer

    def check_callable(self) -> None:
        if self.scorer is None:
            raise MissingInputError(
                f"reward {self.name!r} needs token log-probs from the backend: bind a scorer "
                f"(get_reward({self.name!r}, scorer=backend) or reward.scorer = backend, where "
                "backend has token_logprobs(prompts, continuations)) or call "
                "reward.score_with_logprobs(completions, answers, prompts, logprobs)"
            )

    def __call__(
        self, completions: list[str], answers: list[str | None], prompts: list[str]
    ) -> list[float | None]:
        self.check_callable()
        assert self.scorer is not None
        if COMPLETION_LOGPROBS in self.needs:
            logprobs: list[Sequence[float] | None] = list(
                self.scorer.token_logprobs(list(prompts), list(completions))
            )
        else:
            logprobs = self._reference_logprobs(self.scorer, answers, prompts)
        return self.score_with_logprobs(completions, answers, prompts, logprobs)

    @staticmethod
    def _reference_logprobs(
        scorer: LogprobScorer, answers: Sequence[str | None], prompts: Sequence[str]
    ) -> list[Sequence[float] | None]:
        """Score each distinct (prompt, reference) pair once: a population shares its prompts."""
        pairs = sorted({(p, a) for p, a in zip(prompts, answers, strict=True) if a})
        scored = (
            scorer.token_logprobs([p for p, _ in pairs], [a for _, a in pairs]) if pairs else []
        )
        by_pair = dict(zip(pairs, scored, strict=True))
        return [by_pair.get((p, a)) if a else None for p, a in zip(prompts, answers, strict=True)]

    def score_with_logprobs(
        self,
        completions: list[str],
        answers: list[str | None],
        prompts: list[str],
        logprobs: Sequence[Sequence[float] | None],
    ) -> list[float | None]:
        """Score with precomputed token log-probs of the sequences named by ``needs``."""
        return self._score_columns(
            ("completions", "answers", "prompts", "logprobs"),
            (completions, answers, prompts, list(logprobs)),
        )


def _checked_logprobs(values: Sequence[float]) -> list[float]:
    out = [float(value) for value in values]
    for value in out:
        if math.isnan(value) or value == math.inf or value > 1e-4:
            raise ValueError(f"token log-prob {value} is not in [-inf, 0]")
    return out


def sequence_confidence(logprobs: Sequence[float], *, use_length_norm: bool = True) -> float:
    """``pi(y|x) = exp(sum_t log pi(y_t | x, y_<t))``, or with ``use_length_norm`` the
    per-token geometric mean ``exp(mean_t log pi(y_t | ...))``; ValueError for no tokens.

    >>> sequence_confidence([math.log(0.5), math.log(0.5)], use_length_norm=False)
    0.25
    >>> round(sequence_confidence([math.log(0.5), math.log(0.5)]), 12)
    0.5
    """
    values = _checked_logprobs(logprobs)
    if not values:
        raise ValueError("no tokens to score")
    total = math.fsum(values)
    return math.exp(total / len(values) if use_length_norm else total)


def self_confidence(
    stats: RewardStats, *, use_length_norm: bool = True, alpha: float = 0.0
) -> LogprobScoreFn:
    """RLSC self-confidence (spec §7.3, "Confidence Is All You Need", arXiv 2506.06395).

    ``R_i = pi(y_i|x) + alpha``, with ``pi(y|x) = exp(sum_t log pi(y_t | x, y_<t))`` over the
    completion's tokens (``use_length_norm=False``), or the length-normalised
    ``exp((1/T) sum_t log pi(y_t | ...))`` (default: the raw sequence probability of a long
    reasoning chain underflows to 0 for every sample). Needs the completions' token log-probs
    (``needs == {"completion_logprobs"}``, see the module docstring). None for an empty
    completion (no tokens). Labels are ignored.

    Why this reward: RLSC maximises ``F = E_{y~pi}[pi(y|x)]``; the REINFORCE weight of a sample
    in ``grad F`` is ``pi_old(y|x)`` (the paper's loss L1), and ``+ alpha`` gives the smoothed
    loss L2. The paper's alpha and whether it length-normalises are not verified (spec).

    >>> from essa.rewards import get_reward
    >>> conf = get_reward("self_confidence", use_length_norm=False)
    >>> conf.score_with_logprobs(["a", "b"], [None, None], ["q", "q"], [[math.log(0.5)] * 2, []])
    [0.25, None]
    """
    if not math.isfinite(alpha):
        raise ValueError(f"alpha must be finite, got {alpha}")

    def score(
        completions: list[str],
        answers: list[str | None],
        prompts: list[str],
        logprobs: list[Sequence[float] | None],
    ) -> list[float | None]:
        return [
            None
            if not tokens
            else sequence_confidence(tokens, use_length_norm=use_length_norm) + alpha
            for tokens in logprobs
        ]

    return score


def reference_logprob(stats: RewardStats) -> LogprobScoreFn:
    """Mean token log-probability of the reference under the candidate, teacher-forced.

    ``R_i = (1/|y*|) sum_t log pi(y*_t | x, y*_<t)`` where ``y* = answers[i]`` is the reference
    (pass full reference solutions there, e.g. ``Example.target``, for a dense signal) and
    ``x = prompts[i]``. The completion is ignored, so no sampling noise enters: a dense,
    low-noise ES fitness when references exist. None when the reference is None or empty.
    Needs ``{"reference_logprobs"}`` (see the module docstring); with a bound scorer each
    distinct (prompt, reference) pair is scored once per call.

    A *different objective* from RL on outcomes: it rewards assigning likelihood to the given
    solution text (behaviour cloning by search), not producing a correct answer; it cannot
    reward a correct solution that differs from the reference, nor exceed the reference.

    >>> from essa.rewards import get_reward
    >>> ref = get_reward("reference_logprob")
    >>> ref.score_with_logprobs(["", ""], ["ab", None], ["q", "q"], [[-1.0, -2.0], None])
    [-1.5, None]
    """

    def score(
        completions: list[str],
        answers: list[str | None],
        prompts: list[str],
        logprobs: list[Sequence[float] | None],
    ) -> list[float | None]:
        scores: list[float | None] = []
        for answer, tokens in zip(answers, logprobs, strict=True):
            if not answer or tokens is None:
                scores.append(None)
                continue
            values = _checked_logprobs(tokens)
            scores.append(math.fsum(values) / len(values) if values else None)
        return scores

    return score
