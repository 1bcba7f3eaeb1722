"""Test doubles for the typed seams (essa/protocols.py) that need no model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from essa.protocols import RowProgress
from essa.types import Population


@dataclass
class FakeStats:
    seconds: float = 0.0
    new_tokens: int = 0
    sequences: int = 0


class FakeEvaluator:
    """An :class:`essa.protocols.Evaluator` whose completions are a pure function of the candidate.

    Candidate x answers ``"4"`` to a prompt when ``x[0] + x[1] > threshold`` and ``"5"``
    otherwise, so a search that raises the first two coordinates raises the fitness; a
    candidate with a non-finite coordinate is flagged in ``nonfinite``.
    """

    def __init__(self, threshold: float = 0.0) -> None:
        self.threshold = threshold
        self.stats = FakeStats()
        self.chosen: dict[int, str] = {}
        self.nonfinite = np.zeros(0, dtype=bool)
        self.calls = 0

    def completions(
        self,
        population: Population,
        prompts: Sequence[str],
        seed: int | None = None,
        progress: RowProgress | None = None,
        samples: int = 1,
        *,
        greedy: bool = False,  # the fake is deterministic either way
    ) -> list[list[str]]:
        population = np.atleast_2d(population)  # (P, D)
        prompts = [p for p in prompts for _ in range(samples)]
        self.calls += 1
        self.nonfinite = ~np.isfinite(population).all(axis=1)  # (P,)
        out = []
        for x in population:
            answer = "4" if x[0] + x[1] > self.threshold else "5"
            out.append([answer] * len(prompts))
            if progress is not None:
                progress(len(prompts))
        self.stats.new_tokens += len(population) * len(prompts)
        self.stats.sequences += len(population) * len(prompts)
        return out
