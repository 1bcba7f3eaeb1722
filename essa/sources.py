"""The data sources a config may name, and reasoning-gym's datasets: nothing of essa imported.

The config checks source names against these (``evaluation.drift.retention``), the loaders of
:mod:`essa.data` build examples from them, and the ``gym_score`` reward regenerates a
reasoning-gym dataset to grade a completion (:mod:`essa.rewards.gym`). Kept below all three, so
that none of those packages imports another for them.

``reasoning_gym:TASK`` needs ``pip install reasoning-gym`` (Apache-2.0; the ``[gym]`` extra);
``reasoning_gym`` is imported only when such a source or the ``gym_score`` reward is used. The
task is generated once with fixed ``size`` and ``seed`` (:data:`GYM_SIZE`, :data:`GYM_SEED`):
the last :data:`GYM_NUM_TEST` entries are the held-out ``split="test"``
(:func:`essa.data.gym.gym_examples`); the ``gym_score`` reward regenerates the same dataset
(same defaults) to grade a completion with the task's own ``score_answer``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# The built-in generated tasks (essa.data.loaders.builtin_examples): two-digit addition and the
# levels of essa.data.generators.ARITHMETIC_LEVELS (tests/test_data_generators.py keeps the
# two in step).
BUILTIN_SOURCES = ("builtin:arithmetic", "builtin:arithmetic3", "builtin:arithmetic_mixed")

GYM_PREFIX = "reasoning_gym:"
GYM_SIZE = 2000
GYM_SEED = 20251129
GYM_NUM_TEST = 200


def gym_dataset(
    task: str,
    *,
    size: int = GYM_SIZE,
    seed: int = GYM_SEED,
    params: Mapping[str, Any] | None = None,
) -> Any:
    """``reasoning_gym.create_dataset(task, size=size, seed=seed, **params)`` with clear errors.

    ``params`` are fields of the task's own config dataclass (e.g. ``min_digits``,
    ``max_terms``: the difficulty); an unknown field or a value its ``validate`` rejects is a
    ValueError naming it.
    """
    import_error = (
        f"task {task!r} needs reasoning-gym (pip install reasoning-gym, or the [gym] extra)"
    )
    known = gym_tasks(import_error)
    if task not in known:
        raise ValueError(f"unknown reasoning-gym task {task!r}; known: {', '.join(known)}")
    import reasoning_gym

    params = dict(params or {})
    _check_params(task, reasoning_gym.factory.DATASETS[task][1], params)
    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed, **params)
    except (AssertionError, ValueError, TypeError) as err:  # the config's validate()
        raise ValueError(f"data.params {params}: rejected by {task}: {err}") from None


def gym_tasks(import_error: str) -> list[str]:
    """reasoning-gym's task names, sorted; ValueError(``import_error``) when it is not installed."""
    try:
        import reasoning_gym
    except ImportError as error:
        raise ValueError(import_error) from error
    return sorted(reasoning_gym.factory.DATASETS)


def _check_params(task: str, config_cls: type, params: dict[str, Any]) -> None:
    known = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
    for key in params:
        if key not in known:
            raise ValueError(
                f"data.params.{key}: not a parameter of {task} (known: {', '.join(known)})"
            )
