"""Rewards for math reasoning: ``get_reward(name, **params)`` returns a batch callable.

    reward = get_reward("math_accuracy")
    scores = reward(completions, answers, prompts)   # list[float | None], None = not gradable
    reward.stats.as_dict()                           # n_items, n_none, n_error, n_timeout
    fitness = fitness_from_rewards(scores)           # mean of non-None, NaN if all None

Imports only numpy, the standard library and (lazily, when verifying) math-verify; never
torch, transformers, models or recipes. Spec: rewards-and-eval.md.
"""

from essa.rewards.accuracy import MathVerifier
from essa.rewards.base import Reward, RewardStats, ScoreFn, combine, fitness_from_rewards
from essa.rewards.extract import extract_answer, last_boxed, normalize_answer, normalize_gold
from essa.rewards.grading import Grade
from essa.rewards.registry import REWARDS, get_reward, known_rewards

__all__ = [
    "REWARDS",
    "Grade",
    "MathVerifier",
    "Reward",
    "RewardStats",
    "ScoreFn",
    "combine",
    "extract_answer",
    "fitness_from_rewards",
    "get_reward",
    "known_rewards",
    "last_boxed",
    "normalize_answer",
    "normalize_gold",
]
