"""Built-in arithmetic task: ``a+b=`` -> ``a+b`` with a fixed held-out split.

The split is a pure function of the pair space and a constant seed, so every run, the
bundled demo model's build script and the tests agree on which pairs are held out.
The bundled demo model never saw a held-out pair during pretraining.
"""

from __future__ import annotations

import numpy as np

from essa.types import Example

SPLIT_SEED = 20251129
NUM_TEST = 1000


def prompt_for(a: int, b: int) -> str:
    return f"{a}+{b}="


def all_pairs(max_operand: int = 99) -> list[tuple[int, int]]:
    return [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]


def split_pairs(max_operand: int = 99) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Return (train_pool, test) pairs; test is the fixed held-out set of NUM_TEST pairs."""
    pairs = all_pairs(max_operand)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(pairs))
    shuffled = [pairs[i] for i in order]
    return shuffled[NUM_TEST:], shuffled[:NUM_TEST]


def to_example(a: int, b: int) -> Example:
    return Example(prompt=prompt_for(a, b), answer=str(a + b), solution=str(a + b))


def arithmetic_examples(max_operand: int = 99) -> tuple[list[Example], list[Example]]:
    """(train, test) Example lists of the built-in task."""
    train, test = split_pairs(max_operand)
    return [to_example(a, b) for a, b in train], [to_example(a, b) for a, b in test]
