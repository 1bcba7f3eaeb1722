"""Built-in arithmetic difficulty levels beyond ``builtin:arithmetic``.

``builtin:arithmetic`` (two-digit ``a+b=``, :mod:`essa.data.arithmetic`) is unchanged; the
bundled demo model depends on its exact split. The levels here follow the same recipe with
their own constant split seeds:

- ``builtin:arithmetic3``: three-digit addition ``a+b=`` with ``a, b`` in 100..999 (810,000
  problems; the training pool is capped at 20,000);
- ``builtin:arithmetic_mixed``: ``a+b=``, ``a-b=`` (answers may be negative) and ``a*b=`` with
  ``a, b`` in 0..99 (30,000 problems; the training pool is all 29,000 non-test ones).

Every problem of a level has an index ``op * span**2 + (a - low) * span + (b - low)``. One
permutation from ``np.random.default_rng(split_seed)`` fixes the held-out test set (its first
``num_test`` indices) and the training pool (the next ``num_train``), so every run and every
machine agree on them, independently of the run seed. Completions are graded against the bare
integer answer (``exact_match`` or ``math_accuracy``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from essa.types import Example

OPERATORS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}


@dataclass(frozen=True)
class ArithmeticLevel:
    operators: tuple[str, ...]  # subset of OPERATORS, in index order
    low: int  # smallest operand
    high: int  # largest operand (inclusive)
    split_seed: int  # fixes the held-out set; never change for an existing level
    num_test: int = 1000  # held-out problems
    num_train: int | None = None  # cap on the training pool (None: every non-test problem)

    @property
    def size(self) -> int:
        return len(self.operators) * (self.high - self.low + 1) ** 2

    def problem(self, index: int) -> tuple[int, str, int]:
        """``(a, op, b)`` of problem ``index``."""
        span = self.high - self.low + 1
        op, rest = divmod(index, span * span)
        a, b = divmod(rest, span)
        return a + self.low, self.operators[op], b + self.low


ARITHMETIC_LEVELS: dict[str, ArithmeticLevel] = {
    "arithmetic3": ArithmeticLevel(("+",), 100, 999, split_seed=20260301, num_train=20_000),
    "arithmetic_mixed": ArithmeticLevel(("+", "-", "*"), 0, 99, split_seed=20260302),
}


def to_example(a: int, op: str, b: int) -> Example:
    """``"a{op}b="`` -> the integer result as a string.

    >>> to_example(12, "-", 30)
    Example(prompt='12-30=', answer='-18', solution='-18')
    """
    answer = str(OPERATORS[op](a, b))
    return Example(prompt=f"{a}{op}{b}=", answer=answer, solution=answer)


def level_examples(name: str) -> tuple[list[Example], list[Example]]:
    """``(train, test)`` examples of the arithmetic level ``name`` (a key of
    :data:`ARITHMETIC_LEVELS`), in the fixed split order."""
    level = ARITHMETIC_LEVELS[name]
    order = np.random.default_rng(level.split_seed).permutation(level.size)
    stop = None if level.num_train is None else level.num_test + level.num_train
    test = [to_example(*level.problem(int(i))) for i in order[: level.num_test]]
    train = [to_example(*level.problem(int(i))) for i in order[level.num_test : stop]]
    return train, test
