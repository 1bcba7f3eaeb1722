"""Reward registry: name -> factory, plus custom rewards named ``"module:function"``.

A factory takes the reward's :class:`RewardStats` (so that it can count timeouts) and keyword
parameters, and returns the plain batch function that :class:`Reward` wraps.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from essa.rewards.accuracy import math_accuracy
from essa.rewards.base import Reward, RewardStats, ScoreFn
from essa.rewards.shaping import exact_match, format_reward, length, overlong
from essa.rewards.spurious import incorrect_label, random_reward

RewardFactory = Callable[..., ScoreFn]

REWARDS: dict[str, RewardFactory] = {
    "math_accuracy": math_accuracy,
    "format": format_reward,
    "exact_match": exact_match,
    "length": length,
    "overlong": overlong,
    "random": random_reward,
    "incorrect_label": incorrect_label,
}


def known_rewards() -> list[str]:
    """Registered reward names, sorted."""
    return sorted(REWARDS)


def _load_custom(name: str, params: dict[str, object]) -> ScoreFn:
    """Import ``module:function``. The object is the batch function itself or, when ``params``
    are given, a factory called as ``function(**params)`` that returns it."""
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"custom reward {name!r} must be written 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"custom reward {name!r}: cannot import module {module_name!r}: {error}"
        ) from error
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(
                f"custom reward {name!r}: module {module_name!r} has no attribute {attribute!r}"
            )
        target = getattr(target, part)
    fn = target(**params) if params else target
    if not callable(fn):
        raise ValueError(f"custom reward {name!r} is not callable (got {type(fn).__name__})")
    return fn


def _check_params(name: str, factory: RewardFactory, params: dict[str, object]) -> None:
    accepted = [p for p in inspect.signature(factory).parameters if p != "stats"]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(
            f"reward {name!r} got unknown parameter(s) {', '.join(unknown)}; "
            f"accepted: {', '.join(accepted) or 'none'}"
        )


def get_reward(name: str, **params: object) -> Reward:
    """The reward registered as ``name`` (see :func:`known_rewards`) built with ``params``,
    or a custom reward ``"module:function"`` imported now.

    A custom ``function`` has the batch signature
    ``(completions: list[str], answers: list[str | None], prompts: list[str]) -> list[float | None]``;
    with ``params`` it is a factory instead, called once as ``function(**params)``.

    >>> get_reward("exact_match")(["4"], ["4"], ["2+2="])
    [1.0]
    """
    stats = RewardStats()
    if ":" in name:
        return Reward(name, _load_custom(name, params), stats)
    factory = REWARDS.get(name)
    if factory is None:
        raise ValueError(
            f"unknown reward {name!r}; known rewards: {', '.join(known_rewards())} "
            "(or 'module:function' for a custom reward)"
        )
    _check_params(name, factory, params)
    return Reward(name, factory(stats, **params), stats)
