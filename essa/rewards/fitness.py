"""ES fitness from rewards: one number per candidate over its k samples of N shared prompts.

Layout (the evaluator's, candidate-major): ``texts[c]`` holds candidate c's N * k completions
prompt-major, item ``i * k + j`` being sample j of prompt i. Every candidate answers the same
(prompt, sample) pairs under common random numbers, so fitness differences come from the
parameters, not the sampling noise.

* A plain reward scores each completion; a group reward (``majority_vote``,
  ``answer_frequency``, ``noisy``; ``pool: group``) scores each candidate's k samples of a
  prompt as one group (TTRL's vote within one policy's samples).
* ``pool: population`` (majority_vote only) votes over every candidate's completions of the
  prompt, on all ranks (:mod:`essa.rewards.pool`): only 8-byte answer keys are gathered. The
  reward's ``use_last_number`` and ``min_group_size`` hold as in a group vote; the group of a
  prompt is the P * k completions of all candidates.
* Log-prob rewards take ``logprobs[c][item]`` from the backend (generated tokens' log-probs
  for ``completion_logprobs``, the teacher-forced reference for ``reference_logprobs``).
* Random rewards (``random``, ``noisy``) draw at ``keys[c][item]``, the item's place in the run
  (:mod:`essa.rewards.base`), so a candidate's draws do not depend on the rank or the shard
  position it is evaluated at.

The fitness of a candidate is the mean over prompts and samples of its gradable rewards (NaN
when none is gradable: a failed evaluation).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from essa.rewards.base import DRAW_KEYS, DrawKey, KeyedReward, Reward, fitness_from_rewards
from essa.rewards.label_free import MIN_GROUP_SIZE
from essa.rewards.pool import (
    agreement_rewards,
    answer_key,
    answer_keys,
    majority_share,
    population_majority,
)


class KeyGather(Protocol):
    """The one collective the population pool needs (essa.dist's communicators have it)."""

    def allgather_keys(self, local: np.ndarray) -> np.ndarray: ...


def expand(items: Sequence[object], k: int) -> list[object]:
    """Each item k times in a row: the prompt-major layout of k samples per prompt."""
    return [item for item in items for _ in range(k)]


def sample_groups(num_prompts: int, k: int) -> list[list[int]]:
    """Columns of each prompt in the prompt-major layout: ``[[0..k-1], [k..2k-1], ...]``."""
    return [list(range(i * k, (i + 1) * k)) for i in range(num_prompts)]


def candidate_scores(
    reward: Reward,
    texts: Sequence[Sequence[str]],
    answers: Sequence[str | None],
    prompts: Sequence[str],
    *,
    samples_per_prompt: int = 1,
    logprobs: Sequence[Sequence[Sequence[float] | None]] | None = None,
    comm: KeyGather | None = None,
    keys: Sequence[Sequence[DrawKey]] | None = None,
) -> tuple[list[list[float | None]], dict[str, float]]:
    """Per candidate of this rank, the reward of each of its N * k items; plus pool metrics.

    ``comm`` is required for ``reward.pool == "population"`` (the vote spans all ranks),
    ``keys`` (per candidate, per item) for a reward that needs draw keys.
    """
    k = samples_per_prompt
    answers_k, prompts_k = expand(answers, k), expand(prompts, k)
    if reward.pool == "population":
        if comm is None:
            raise ValueError("pool: population needs the communicator (the vote spans ranks)")
        return _population_pool(texts, answers, k, comm, **_vote_params(reward))
    if DRAW_KEYS in reward.needs:
        if keys is None:
            raise ValueError(f"reward {reward.name!r} draws at the items' keys: pass keys")
        assert isinstance(reward, KeyedReward)
        scored = [
            reward.score_with_keys(list(t), answers_k, prompts_k, list(kk))  # type: ignore[arg-type]
            for t, kk in zip(texts, keys, strict=True)
        ]
        return scored, {}
    if reward.needs:
        if logprobs is None:
            raise ValueError(f"reward {reward.name!r} needs log-probs from the backend")
        scored = [
            reward.score_with_logprobs(list(t), answers_k, prompts_k, list(lp))  # type: ignore[attr-defined]
            for t, lp in zip(texts, logprobs, strict=True)
        ]
        return scored, {}
    return [reward(list(t), answers_k, prompts_k) for t in texts], {}  # type: ignore[arg-type]


def _vote_params(reward: Reward) -> dict[str, Any]:
    """The majority_vote parameters that the population vote honours, where given."""
    return {
        p: reward.params[p] for p in ("use_last_number", "min_group_size") if p in reward.params
    }


def _population_pool(
    texts: Sequence[Sequence[str]],
    answers: Sequence[str | None],
    k: int,
    comm: KeyGather,
    *,
    use_last_number: bool = True,
    min_group_size: int = MIN_GROUP_SIZE,
) -> tuple[list[list[float | None]], dict[str, float]]:
    num_prompts = len(answers)
    groups = sample_groups(num_prompts, k)
    local = answer_keys(texts, use_last_number=use_last_number)
    local = local.reshape(len(texts), num_prompts * k)  # (p, N * k)
    keys = comm.allgather_keys(local)  # (P, N * k): 8 bytes per answer cross ranks
    majority = population_majority(keys, groups)
    rewards = agreement_rewards(local, majority, groups)  # (p, N * k)
    metrics = {
        "majority_share": majority_share(keys, majority, groups),
        "answered_share": float((keys != 0).mean()) if keys.size else float("nan"),
    }
    # Diagnostic only (never in the fitness): how often the vote is right, where labels exist.
    # A share that falls while majority_share rises is the pool locking in a wrong consensus.
    labelled = [g for g, a in enumerate(answers) if a is not None]
    if labelled:
        gold = [answer_key(str(answers[g])) for g in labelled]
        metrics["majority_correct_share"] = float(np.mean(majority[labelled] == gold))
    # A prompt's group is every candidate's k completions of it, on all ranks: P * k.
    if keys.shape[0] * k < min_group_size:
        return [[None] * rewards.shape[1] for _ in range(rewards.shape[0])], metrics
    return [list(map(float, row)) for row in rewards], metrics


def fitness(scores: Sequence[Sequence[float | None]]) -> np.ndarray:
    """(p,) float64: each candidate's mean gradable reward, NaN when none is gradable."""
    return np.array([fitness_from_rewards(s) for s in scores], dtype=np.float64)
