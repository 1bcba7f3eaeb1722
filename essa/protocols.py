"""The typed seams between the packages: what a recipe may call on an evaluator or optimizer.

Structural (typing.Protocol): the HF and vLLM evaluators, every optimizer and the tests' fake
evaluator satisfy them without inheriting from anything. docs/contracts.md lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from essa.optimizers.base import Optimizer
from essa.types import Population

# Called with the number of rows (candidate x prompt completions) just finished.
RowProgress = Callable[[int], None]


class GenerationStats(Protocol):
    """Running totals of an evaluator (the recipes log per-call differences)."""

    seconds: float
    new_tokens: int
    sequences: int


@runtime_checkable
class Evaluator(Protocol):
    """Completions of a population of adapter candidates on shared prompts."""

    @property
    def stats(self) -> GenerationStats: ...

    @property
    def chosen(self) -> dict[int, str]:
        """Number of prompts -> the evaluation strategy picked for it (empty when none)."""
        ...

    @property
    def nonfinite(self) -> NDArray[np.bool_]:
        """(P,) of the last call: candidates whose logits or log-probs were NaN/inf (fault flag)."""
        ...

    def completions(
        self,
        population: Population,
        prompts: Sequence[str],
        seed: int | None = None,
        progress: RowProgress | None = None,
        samples: int = 1,
        *,
        greedy: bool = False,
    ) -> list[list[str]]:
        """completions[candidate][item] for population (P, D), item ``i * samples + j`` the
        j-th sample of prompt i, drawn from the same random stream for every candidate
        (common random numbers); ``progress`` after each batch. ``greedy`` decodes greedily
        whatever ``generation.temperature`` (held-out scoring)."""
        ...


@runtime_checkable
class LogprobEvaluator(Evaluator, Protocol):
    """An evaluator that also returns the sampled tokens' log-probs (vLLM; HF when its
    ``record_logprobs`` is set)."""

    @property
    def last_logprobs(self) -> list[list[list[float]]]:
        """[candidate][prompt][token] log pi of each sampled token of the last call."""
        ...


@runtime_checkable
class ReferenceScorer(Protocol):
    """An evaluator that scores given continuations teacher-forced, per candidate (HF)."""

    def reference_logprobs(
        self, population: Population, prompts: Sequence[str], continuations: Sequence[str]
    ) -> list[list[list[float]]]:
        """[candidate][item][token] log pi_c(y_t | x, y_<t) of continuations[item]."""
        ...


@runtime_checkable
class ReferenceForcingEvaluator(Evaluator, Protocol):
    """An evaluator that teacher-forces each prompt's reference in the generation's own
    prefill (HF): the dense tie-breaker of ``reward.reference_weight``."""

    def completions(
        self,
        population: Population,
        prompts: Sequence[str],
        seed: int | None = None,
        progress: RowProgress | None = None,
        samples: int = 1,
        references: Sequence[str | None] | None = None,
        *,
        greedy: bool = False,
    ) -> list[list[str]]:
        """As :meth:`Evaluator.completions`; with ``references`` (one per prompt) also fills
        :attr:`last_reference_logprobs`."""
        ...

    @property
    def last_reference_logprobs(self) -> list[list[list[float]]]:
        """[candidate][item][token] log pi_c(y*_t | x, y*_<t) of the last call's references."""
        ...


__all__ = [
    "Evaluator",
    "GenerationStats",
    "LogprobEvaluator",
    "Optimizer",
    "ReferenceForcingEvaluator",
    "ReferenceScorer",
    "RowProgress",
]
