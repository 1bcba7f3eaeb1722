"""The typed seams between the packages: what a recipe may call on an evaluator or optimizer.

Structural (typing.Protocol): the HF and vLLM evaluators, every optimizer and the tests' fake
evaluator satisfy them without inheriting from anything. docs/architecture.md lists them.
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
    ) -> list[list[str]]:
        """completions[candidate][prompt] for population (P, D); ``progress`` after each batch."""
        ...


@runtime_checkable
class LogprobEvaluator(Evaluator, Protocol):
    """An evaluator that also returns the sampled tokens' log-probs (vLLM)."""

    @property
    def last_logprobs(self) -> list[list[list[float]]]:
        """[candidate][prompt][token] log pi of each sampled token of the last call."""
        ...


__all__ = ["Evaluator", "GenerationStats", "LogprobEvaluator", "Optimizer", "RowProgress"]
