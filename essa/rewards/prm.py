"""``prm``: process rewards. A process-reward model scores every reasoning step of a completion;
the step scores are refined (Clip / Delta), aggregated (sum, last, min, mean) and added to the
outcome reward by weight. Spec, formulas and sources: docs/process-rewards.md.

This module is the pure half (standard library only): step splitting, the refinement and
aggregation rules, and the reward built on a :class:`StepScorer`, the hook that holds a model:

    step_scores(prompts, completions, step_ends) -> list[list[float]]

``step_ends[i]`` are the character offsets in ``completions[i]`` where its steps end
(exclusive); the scorer returns one score per step, in order. The Hugging Face scorer
(token-classification or sequence-classification head) lives in :mod:`essa.rewards.prm_model`
and is imported only when a ``prm`` path is given, so ``import essa.rewards`` stays light.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from essa.rewards.base import RewardStats, ScoreFn

AGGREGATES = ("sum", "last", "min", "mean")
REFINEMENTS = ("none", "clip", "delta")


@runtime_checkable
class StepScorer(Protocol):
    """The model hook of ``prm`` (see the module docstring)."""

    def step_scores(
        self, prompts: list[str], completions: list[str], step_ends: list[list[int]]
    ) -> list[list[float]]:
        """One score per step end of each completion (given its prompt), in order."""
        ...


def step_ends(text: str, delimiter: str = "\n\n") -> list[int]:
    """Character offsets (exclusive) where the steps of ``text`` end, split at ``delimiter``.

    A step is the text between delimiters, without the delimiter; blank steps (runs of
    delimiters, trailing whitespace) are skipped.

    >>> step_ends("a=1\\n\\nb=2\\n\\n", "\\n\\n")
    [3, 8]
    >>> step_ends("   ", "\\n")
    []
    """
    if not delimiter:
        raise ValueError("step_delimiter must not be empty")
    ends = []
    start = 0
    for piece in text.split(delimiter):
        if piece.strip():
            ends.append(start + len(piece.rstrip()))
        start += len(piece) + len(delimiter)
    return ends


def clip_rewards(scores: Sequence[float], threshold: float) -> list[float]:
    """Clip (Gao et al., arXiv 2410.15115): ``r'_k = min(r_k - threshold, 0)``; every step is
    <= 0, so adding steps can never raise a sum.

    >>> clip_rewards([0.75, 0.25, 0.5], 0.5)
    [0.0, -0.25, 0.0]
    """
    return [min(s - threshold, 0.0) for s in scores]


def delta_rewards(scores: Sequence[float]) -> list[float]:
    """Delta (Gao et al., arXiv 2410.15115): ``r'_k = r_k - r_{k+1}`` for k < K and
    ``r'_K = 0`` (the last step's score is dropped; the outcome reward grades the end). The
    sum from step t telescopes to ``r_t - r_K``, so no number of steps can grow it.

    >>> delta_rewards([0.75, 0.25, 0.5, 1.0])
    [0.5, -0.25, -0.5, 0.0]
    """
    values = list(scores)
    return [a - b for a, b in zip(values, values[1:], strict=False)] + ([0.0] if values else [])


def aggregate_steps(scores: Sequence[float], rule: str) -> float:
    """One number from a completion's (refined) step rewards; 0.0 when it has no step.

    ``sum`` (the canonical return), ``last`` (the final step's), ``min`` (PURE's min-form
    credit, arXiv 2504.15275: the value is the minimum over steps), ``mean``.

    >>> [aggregate_steps([0.5, -0.25, 1.0], r) for r in AGGREGATES]
    [1.25, 1.0, -0.25, 0.4166666666666667]
    """
    if rule not in AGGREGATES:
        raise ValueError(f"unknown aggregate {rule!r}; known: {', '.join(AGGREGATES)}")
    values = [float(s) for s in scores]
    if not values:
        return 0.0
    if rule == "sum":
        return math.fsum(values)
    if rule == "last":
        return values[-1]
    if rule == "min":
        return min(values)
    return math.fsum(values) / len(values)


def process_reward(
    scores: Sequence[float], *, aggregate: str, refine: str, clip_threshold: float
) -> float:
    """Refine the step scores (``none``, ``clip``, ``delta``), then aggregate them.

    >>> process_reward([0.75, 0.25, 0.5], aggregate="sum", refine="clip", clip_threshold=0.5)
    -0.25
    """
    return aggregate_steps(refine_steps(scores, refine, clip_threshold), aggregate)


def refine_steps(scores: Sequence[float], refine: str, clip_threshold: float) -> list[float]:
    """The refined step rewards r'_k (``none``, ``clip`` or ``delta``)."""
    if refine == "clip":
        return clip_rewards(scores, clip_threshold)
    if refine == "delta":
        return delta_rewards(scores)
    if refine != "none":
        raise ValueError(f"unknown refine {refine!r}; known: {', '.join(REFINEMENTS)}")
    return [float(s) for s in scores]


def step_returns(
    scores: Sequence[float], *, aggregate: str, refine: str, clip_threshold: float
) -> list[float]:
    """G_k, the value of the completion from step k on: the aggregate over steps k..K of the
    refined rewards (``min``: PURE's min-form value ``min_{j >= k} r'_j``; ``sum``: the
    return; ``mean``; ``last``: r'_K for every step). G_1 is :func:`process_reward`'s value.

    >>> step_returns([0.75, 0.25, 0.5, 1.0], aggregate="min", refine="none", clip_threshold=0.5)
    [0.25, 0.25, 0.5, 1.0]
    >>> step_returns([0.75, 0.25, 0.5], aggregate="sum", refine="clip", clip_threshold=0.5)
    [-0.25, -0.25, 0.0]
    """
    refined = refine_steps(scores, refine, clip_threshold)
    return [aggregate_steps(refined[k:], aggregate) for k in range(len(refined))]


class PRMScore:
    """The ``prm`` score function; it also gives each completion's step ends and step values
    (:meth:`steps`), which the GRPO recipe turns into per-token credit (``grpo.prm_credit``)."""

    def __init__(
        self,
        scorer: StepScorer | None,
        outcome_fn: ScoreFn | None,
        *,
        step_delimiter: str,
        aggregate: str,
        refine: str,
        clip_threshold: float,
        outcome_weight: float,
        prm_weight: float,
    ) -> None:
        self.scorer, self.outcome_fn = scorer, outcome_fn
        self.step_delimiter, self.aggregate = step_delimiter, aggregate
        self.refine, self.clip_threshold = refine, clip_threshold
        self.outcome_weight, self.prm_weight = outcome_weight, prm_weight
        # The last call's step data, so that :meth:`steps` on the same batch needs no second
        # PRM forward: (prompts, completions) -> (ends, returns) per completion.
        self._last: tuple[list[str], list[str], list[tuple[list[int], list[float]]]] | None = None

    def steps(
        self, completions: list[str], prompts: list[str]
    ) -> list[tuple[list[int], list[float]]]:
        """Per completion: its step ends (character offsets) and step values G_1..G_K; the last
        scoring call's when it was on this batch (no second PRM forward)."""
        if self._last is not None and self._last[:2] == (list(prompts), list(completions)):
            return self._last[2]
        return self._steps(completions, prompts)

    def _steps(
        self, completions: list[str], prompts: list[str]
    ) -> list[tuple[list[int], list[float]]]:
        ends = [step_ends(text, self.step_delimiter) for text in completions]
        scores: list[list[float]] = [[] for _ in completions]
        if self.prm_weight and self.scorer is not None:
            scores = self.scorer.step_scores(list(prompts), list(completions), ends)
        out = [
            (e, step_returns(s, aggregate=self.aggregate, refine=self.refine,
                             clip_threshold=self.clip_threshold))
            for e, s in zip(ends, scores, strict=True)
        ]  # fmt: skip
        self._last = (list(prompts), list(completions), out)
        return out

    def __call__(
        self, completions: list[str], answers: list[str | None], prompts: list[str]
    ) -> list[float | None]:
        steps = self._steps(completions, prompts)  # always scored afresh, then kept
        process = [returns[0] if returns else 0.0 for _, returns in steps]
        outcomes: list[float | None] = [0.0] * len(completions)
        if self.outcome_fn is not None:
            outcomes = list(self.outcome_fn(list(completions), list(answers), list(prompts)))
        return [
            None if o is None else self.outcome_weight * o + self.prm_weight * p
            for o, p in zip(outcomes, process, strict=True)
        ]


def prm_reward(
    stats: RewardStats,
    load_outcome: Callable[[str, dict[str, object]], ScoreFn],
    /,
    *,
    prm: str | None = None,
    scorer: StepScorer | None = None,
    head: str = "auto",
    step_delimiter: str = "\n\n",
    aggregate: str = "min",
    refine: str = "none",
    clip_threshold: float = 0.5,
    outcome: str | None = "math_accuracy",
    outcome_params: dict[str, object] | None = None,
    outcome_weight: float = 1.0,
    prm_weight: float = 1.0,
    label_index: int | None = None,
    output: str = "probability",
    batch_size: int = 8,
    device: str | None = None,
) -> PRMScore:
    """``R_i = outcome_weight * outcome_i + prm_weight * agg(refine(step scores of i))``.

    Args:
        prm: local directory of a Hugging Face process-reward model (token- or
            sequence-classification head, ``head``: auto | token | sequence); or ``scorer``,
            any :class:`StepScorer` (Python only: tests, other backends).
        step_delimiter: steps are the completion's pieces between delimiters.
        aggregate: ``min`` (PURE, default), ``sum``, ``last`` or ``mean`` over the steps.
        refine: ``none``, ``clip`` (``min(r - clip_threshold, 0)``) or ``delta``.
        outcome: the outcome reward's registered name (with ``outcome_params``); null: none.
        label_index, output: which class of the head is "step correct" and whether its
            probability (default) or its logit is the step score (:mod:`essa.rewards.prm_model`).

    A completion with no step scores 0.0 for its process part. None when the outcome reward
    is None (ungradable) and ``outcome_weight != 0``.

    >>> class Fixed:
    ...     def step_scores(self, prompts, completions, step_ends):
    ...         return [[0.75, 0.25, 0.5][: len(e)] for e in step_ends]
    >>> from essa.rewards import get_reward
    >>> r = get_reward("prm", scorer=Fixed(), step_delimiter=";", outcome_weight=1.0,
    ...                prm_weight=0.5, aggregate="min")
    >>> r(["1+1=2;2+2=4;so 4"], ["4"], ["q"])
    [1.125]
    """
    _check(aggregate, refine, head, output, prm, scorer, outcome_weight, prm_weight)
    outcome_fn = load_outcome(outcome, outcome_params or {}) if outcome and outcome_weight else None
    if prm_weight and scorer is None:
        from essa.rewards.prm_model import load_step_scorer

        assert prm is not None
        scorer = load_step_scorer(
            prm, head=head, label_index=label_index, output=output, batch_size=batch_size,
            device=device,
        )  # fmt: skip

    return PRMScore(
        scorer, outcome_fn, step_delimiter=step_delimiter, aggregate=aggregate, refine=refine,
        clip_threshold=clip_threshold, outcome_weight=outcome_weight, prm_weight=prm_weight,
    )  # fmt: skip


def _check(
    aggregate: str,
    refine: str,
    head: str,
    output: str,
    prm: str | None,
    scorer: StepScorer | None,
    outcome_weight: float,
    prm_weight: float,
) -> None:
    if aggregate not in AGGREGATES:
        raise ValueError(f"unknown aggregate {aggregate!r}; known: {', '.join(AGGREGATES)}")
    if refine not in REFINEMENTS:
        raise ValueError(f"unknown refine {refine!r}; known: {', '.join(REFINEMENTS)}")
    if head not in ("auto", "token", "sequence"):
        raise ValueError(f"unknown head {head!r}; known: auto, token, sequence")
    if output not in ("probability", "logit"):
        raise ValueError(f"unknown output {output!r}; known: probability, logit")
    for key, value in (("outcome_weight", outcome_weight), ("prm_weight", prm_weight)):
        if not math.isfinite(value):
            raise ValueError(f"{key} must be finite, got {value}")
    if prm_weight and prm is None and scorer is None:
        raise ValueError("prm needs the path of a process-reward model: reward.params.prm: DIR")
