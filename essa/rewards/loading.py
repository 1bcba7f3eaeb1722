"""The configured reward, gated on what the calling recipe can give it.

A recipe says whether it scores groups of completions per prompt and which side inputs
(``reward.needs``) it provides; a reward that needs more is refused with one line before any
model loads. Custom (module:function) rewards get ``reward.timeout_seconds`` as a deadline.
"""

from __future__ import annotations

from typing import Any

from essa.config import GenerationConfig, RewardConfig
from essa.errors import UserError
from essa.rewards.base import DRAW_KEYS, Reward
from essa.rewards.logprob import COMPLETION_LOGPROBS, REFERENCE_LOGPROBS


def load_reward(
    cfg: RewardConfig,
    *,
    recipe: str,
    groups: bool = False,
    provides: frozenset[str] = frozenset(),
    deadline: bool = True,
    group_hint: str = " yet",
) -> Reward:
    """``cfg``'s reward; UserError when unknown or when ``recipe`` cannot feed it."""
    from essa.rewards import get_reward
    from essa.rewards.deadline import with_deadline

    try:
        reward = get_reward(cfg.name, **cfg.params)
    except (ValueError, ImportError) as err:
        raise UserError(f"reward.name: {err}") from None
    if deadline and ":" in cfg.name and cfg.timeout_seconds is not None:
        reward = with_deadline(reward, cfg.timeout_seconds)  # custom code may hang
    missing_group = reward.is_group and not groups
    if missing_group or not reward.needs <= provides:
        needs = "a group of completions per prompt" if missing_group else sorted(reward.needs)
        raise UserError(
            f"reward.name: {cfg.name} needs {needs}, which the {recipe} recipe does not provide"
            f"{group_hint if missing_group else ' on this backend'}"
        )
    return reward


def es_reward_inputs(
    reward: RewardConfig, generation: GenerationConfig, backend: str
) -> dict[str, Any]:
    """What ESSA can feed a reward: groups (k samples, or the population as the vote pool),
    log-probs (generated tokens' on both backends, the reference's teacher-forced on HF) and
    the items' draw keys."""
    k = generation.samples_per_prompt
    pooled = reward.params.get("pool") == "population"
    logprobs = {COMPLETION_LOGPROBS} | (set() if backend == "vllm" else {REFERENCE_LOGPROBS})
    return {
        "groups": k > 1 or pooled,
        "provides": frozenset({*logprobs, DRAW_KEYS}),
        "group_hint": (
            ": set generation.samples_per_prompt >= 2 (with temperature > 0) for a vote among "
            "a candidate's samples, or reward.params.pool: population (majority_vote) for a "
            "vote among the candidates"
        ),
    }


def check_vote_size(generation: GenerationConfig, population_size: int, reward: Reward) -> None:
    """Refuse a group reward's ``min_group_size`` that no ESSA vote reaches: every item would
    be ungradable and every candidate fail. A vote sees a candidate's k samples of a prompt, or
    under ``pool: population`` all P candidates' k samples."""
    size = reward.params.get("min_group_size")
    if not reward.is_group or not isinstance(size, int):
        return
    k = generation.samples_per_prompt
    pooled = reward.pool == "population"
    votes = k * population_size if pooled else k
    if size > votes:
        where = "optimizer.population_size x " if pooled else ""
        raise UserError(
            f"reward.params.min_group_size: {size} is more than the {votes} completions a vote "
            f"sees ({where}generation.samples_per_prompt), so no item could be graded"
        )
