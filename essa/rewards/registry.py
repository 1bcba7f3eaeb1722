"""Reward registry: name -> :class:`RewardSpec`, plus custom rewards named ``"module:function"``.

A spec's factory takes the reward's :class:`RewardStats` (so that it can count timeouts) and
keyword parameters, and returns the plain batch function that :class:`Reward` wraps. The spec
also says whether the reward is a group reward (see :mod:`essa.rewards.base`) and which side
inputs it needs (see :mod:`essa.rewards.logprob`), so a recipe can check before building it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from essa.rewards.accuracy import math_accuracy
from essa.rewards.base import (
    DRAW_KEYS,
    KeyedReward,
    KeyedScoreFn,
    Reward,
    RewardStats,
    ScoreFn,
    noisy,
)
from essa.rewards.formatting import exact_match, format_reward, length, overlong
from essa.rewards.label_free import answer_frequency, majority_vote
from essa.rewards.logprob import (
    COMPLETION_LOGPROBS,
    REFERENCE_LOGPROBS,
    LogprobReward,
    reference_logprob,
    self_confidence,
)
from essa.rewards.pattern import reasoning_pattern
from essa.rewards.spurious import incorrect_label, random_reward

RewardFactory = Callable[..., Any]


def _reward_model(stats: RewardStats, **params: Any) -> ScoreFn:
    from essa.rewards.reward_model import reward_model

    return reward_model(stats, **params)


def _gym_score(stats: RewardStats, **params: Any) -> ScoreFn:
    from essa.rewards.gym import gym_score

    return gym_score(stats, **params)


def _prm(stats: RewardStats, **params: Any) -> ScoreFn:
    """``prm`` from the config: its outcome reward (a plain text reward) is looked up here."""
    from essa.rewards.prm import prm_reward

    def load_outcome(name: str, outcome_params: dict[str, object]) -> ScoreFn:
        outcome = get_reward(name, **outcome_params)
        if outcome.is_group or outcome.needs:
            raise ValueError(f"prm: outcome {name!r} must be a plain text reward")
        return outcome

    return prm_reward(stats, load_outcome, **params)


def _noisy(
    stats: RewardStats,
    *,
    flip_prob: float,
    reward: str = "math_accuracy",
    params: dict[str, Any] | None = None,
    seed: int = 0,
) -> KeyedScoreFn:
    """``noisy`` from the config: ``reward`` (a name) built with ``params``, see :func:`noisy`."""
    return noisy(get_reward(reward, **(params or {})), flip_prob, seed).fn  # type: ignore[return-value]


@dataclass(frozen=True)
class RewardSpec:
    """A registered reward: its factory and what a caller must know before calling it."""

    factory: RewardFactory
    is_group: bool = False  # sees all completions of a prompt together (same call)
    # side input: "completion_logprobs" or "reference_logprobs" (LogprobReward), or "draw_keys"
    # (KeyedReward: the random rewards)
    needs: str | None = None
    # The real signature when ``factory`` is a lazy-import shim (for parameter checks).
    signature_of: Callable[[], Callable[..., Any]] | None = None


def _lazy(module: str, name: str) -> Callable[[], Callable[..., Any]]:
    return lambda: getattr(importlib.import_module(module), name)


REWARDS: dict[str, RewardSpec] = {
    "math_accuracy": RewardSpec(math_accuracy),
    "format": RewardSpec(format_reward),
    "exact_match": RewardSpec(exact_match),
    "length": RewardSpec(length),
    "overlong": RewardSpec(overlong),
    "random": RewardSpec(random_reward, needs=DRAW_KEYS),
    "incorrect_label": RewardSpec(incorrect_label),
    "majority_vote": RewardSpec(majority_vote, is_group=True),
    "answer_frequency": RewardSpec(answer_frequency, is_group=True),
    "reasoning_pattern": RewardSpec(reasoning_pattern),
    "noisy": RewardSpec(_noisy, is_group=True, needs=DRAW_KEYS),
    "self_confidence": RewardSpec(self_confidence, needs=COMPLETION_LOGPROBS),
    "reference_logprob": RewardSpec(reference_logprob, needs=REFERENCE_LOGPROBS),
    "reward_model": RewardSpec(
        _reward_model, signature_of=_lazy("essa.rewards.reward_model", "reward_model")
    ),
    "prm": RewardSpec(_prm, signature_of=_lazy("essa.rewards.prm", "prm_reward")),
    "gym_score": RewardSpec(_gym_score, signature_of=_lazy("essa.rewards.gym", "gym_score")),
}


def reward_spec(name: str) -> RewardSpec:
    """The :class:`RewardSpec` of a registered reward (ValueError listing the known ones)."""
    spec = REWARDS.get(name)
    if spec is None:
        raise ValueError(
            f"unknown reward {name!r}; known rewards: {', '.join(known_rewards())} "
            "(or 'module:function' for a custom reward)"
        )
    return spec


def known_rewards() -> list[str]:
    """Registered reward names, sorted."""
    return sorted(REWARDS)


def _load_custom(name: str, params: dict[str, object]) -> ScoreFn:
    """Import ``module:function``. The object is the batch function itself or, when ``params``
    are given, a factory called as ``function(**params)`` that returns it."""
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"custom reward {name!r} must be written 'module:function'")
    if not all(part.isidentifier() for part in module_name.split(".")):
        # Only importable module names: reward code is never loaded from a file path.
        raise ValueError(
            f"custom reward {name!r}: cannot import module {module_name!r}: not a dotted module "
            "name (file paths are not accepted; put the module on PYTHONPATH)"
        )
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


def _check_params(name: str, spec: RewardSpec, params: dict[str, object]) -> None:
    target = spec.signature_of() if spec.signature_of is not None else spec.factory
    signature = inspect.signature(target).parameters
    # Positional-only parameters are the registry's own (stats, an injected lookup).
    accepted = [p for p, v in signature.items() if p != "stats" and v.kind is not v.POSITIONAL_ONLY]
    if spec.needs in (COMPLETION_LOGPROBS, REFERENCE_LOGPROBS):
        accepted.append("scorer")
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(
            f"reward {name!r} got unknown parameter(s) {', '.join(unknown)}; "
            f"accepted: {', '.join(accepted) or 'none'}"
        )
    missing = [
        p
        for p, parameter in signature.items()
        if p != "stats"
        and parameter.default is inspect.Parameter.empty
        and p not in params
        and parameter.kind is parameter.KEYWORD_ONLY
    ]
    if missing:
        raise ValueError(f"reward {name!r} needs parameter(s) {', '.join(missing)}")


def get_reward(name: str, **params: object) -> Reward:
    """The reward registered as ``name`` (see :func:`known_rewards`) built with ``params``,
    or a custom reward ``"module:function"`` imported now.

    A custom ``function`` has the batch signature
    ``(completions: list[str], answers: list[str | None], prompts: list[str]) -> list[float | None]``;
    with ``params`` it is a factory instead, called once as ``function(**params)``. A batch
    function with a true ``is_group`` attribute is a group reward (``fn.is_group = True``).
    Log-probability rewards (``reward_spec(name).needs``) also accept ``scorer``, the backend
    hook of :mod:`essa.rewards.logprob`.

    >>> get_reward("exact_match")(["4"], ["4"], ["2+2="])
    [1.0]
    """
    stats = RewardStats()
    if ":" in name:
        fn = _load_custom(name, params)
        return Reward(name, fn, stats, is_group=bool(getattr(fn, "is_group", False)))
    spec = reward_spec(name)
    _check_params(name, spec, params)
    if spec.needs == DRAW_KEYS:
        keyed = KeyedReward(name, spec.factory(stats, **params), stats, is_group=spec.is_group)
        keyed.pool = str(params.get("pool", "group"))
        return keyed
    if spec.needs is not None:
        scorer = params.pop("scorer", None)
        fn = spec.factory(stats, **params)
        return LogprobReward(name, fn, stats, target=spec.needs, scorer=scorer)  # type: ignore[arg-type]
    reward = Reward(name, spec.factory(stats, **params), stats, is_group=spec.is_group)
    reward.pool = str(params.get("pool", "group"))
    reward.params = MappingProxyType(dict(params))
    return reward
