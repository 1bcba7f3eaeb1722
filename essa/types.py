"""Type aliases shared across essa-align (names follow the ESSA and ES papers)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

Seed = int
# One search point: offsets added to the SFT singular values, float64, shape (D,).
AdapterVector = NDArray[np.float64]
# A population of candidates, float64, shape (population_size, D).
Population = NDArray[np.float64]
# Higher is better; NaN marks a failed evaluation and is ranked worst.
Fitness = NDArray[np.float64]
Completion = str


@dataclass(frozen=True)
class Example:
    """One task item. ``answer`` is the gold final answer used by rewards (None = unlabeled);
    ``solution`` is the full reference text used for SFT (defaults to the answer)."""

    prompt: str
    answer: str | None = None
    solution: str | None = None

    @property
    def target(self) -> str:
        """Text the SFT stage trains on after the prompt."""
        return self.solution if self.solution is not None else (self.answer or "")


@dataclass(frozen=True)
class PreferencePair:
    """One DPO item: a raw question and two completions, ``chosen`` preferred to ``rejected``."""

    prompt: str
    chosen: str
    rejected: str
