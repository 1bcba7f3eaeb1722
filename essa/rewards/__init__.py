"""Rewards for math reasoning: ``get_reward(name, **params)`` returns a batch callable.

    reward = get_reward("math_accuracy")
    scores = reward(completions, answers, prompts)   # list[float | None], None = not gradable
    reward.stats.as_dict()                           # n_items, n_none, n_error, n_timeout
    fitness = fitness_from_rewards(scores)           # mean of non-None, NaN if all None

Group rewards (``reward.is_group``: ``majority_vote``, ``answer_frequency``, ``noisy``) score
the completions of one prompt together: equal ``prompts`` strings form a group and must come in
the same call (:mod:`essa.rewards.base`). Log-probability rewards (``reward.needs``:
``self_confidence``, ``reference_logprob``) need a backend hook (:mod:`essa.rewards.logprob`).
Random rewards (``reward.needs``: ``random``, ``noisy``) draw at each item's place in the run,
given as draw keys (:class:`KeyedReward`), so their draws do not depend on the call order.

Imports only numpy, the standard library and (lazily, when verifying) math-verify; never
torch, transformers, models or recipes (``reward_model`` imports them when built).
Spec: rewards-and-eval.md.
"""

from essa.rewards.accuracy import MathVerifier
from essa.rewards.base import (
    KeyedReward,
    Reward,
    RewardStats,
    ScoreFn,
    combine,
    fitness_from_rewards,
    group_indices,
    noisy,
)
from essa.rewards.extract import extract_answer, last_boxed, normalize_answer, normalize_gold
from essa.rewards.grading import Grade
from essa.rewards.label_free import cluster_answers, majority_cluster
from essa.rewards.logprob import LogprobReward, LogprobScorer, MissingInputError
from essa.rewards.registry import REWARDS, RewardSpec, get_reward, known_rewards, reward_spec

__all__ = [
    "REWARDS",
    "Grade",
    "KeyedReward",
    "LogprobReward",
    "LogprobScorer",
    "MathVerifier",
    "MissingInputError",
    "Reward",
    "RewardSpec",
    "RewardStats",
    "ScoreFn",
    "cluster_answers",
    "combine",
    "extract_answer",
    "fitness_from_rewards",
    "get_reward",
    "group_indices",
    "known_rewards",
    "last_boxed",
    "majority_cluster",
    "noisy",
    "normalize_answer",
    "normalize_gold",
    "reward_spec",
]
