"""``reasoning_gym:TASK`` sources: a reasoning-gym procedural task as examples (optional extra).

The dataset itself (its fixed size and seed, the task names, ``data.params`` checked against
the task's config) is :mod:`essa.sources`, which the config and the ``gym_score`` reward read
too; this module splits it into examples. The last :data:`GYM_NUM_TEST` entries are the
held-out ``split="test"``; the others, minus any whose question also occurs in the test part,
are the training pool (any other split).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from essa.sources import GYM_NUM_TEST, GYM_PREFIX, GYM_SEED, GYM_SIZE, gym_dataset, gym_tasks
from essa.types import Example

__all__ = [
    "GYM_NUM_TEST",
    "GYM_PREFIX",
    "GYM_SEED",
    "GYM_SIZE",
    "gym_dataset",
    "gym_examples",
    "gym_tasks",
]


def gym_examples(
    task: str, split: str | None = None, params: Mapping[str, Any] | None = None
) -> list[Example]:
    """Examples of reasoning-gym ``task`` (built with ``params``): the fixed test part for
    ``split="test"``, else the training pool (see the module docstring). ``answer`` is the
    task's reference answer."""
    entries = list(gym_dataset(task, params=params))
    train, test = entries[:-GYM_NUM_TEST], entries[-GYM_NUM_TEST:]
    if split == "test":
        chosen = test
    else:
        held_out = {entry["question"] for entry in test}
        chosen = [entry for entry in train if entry["question"] not in held_out]
    return [
        Example(prompt=str(entry["question"]), answer=str(entry["answer"]), solution=None)
        for entry in chosen
    ]
