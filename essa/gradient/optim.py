"""The optimizer of every gradient recipe: AdamW over the trainables, or LISA's AdamW that owns
its layer groups (the schedule and clipping: essa.gradient.schedule)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from essa.config import DPOConfig, GRPOConfig
from essa.gradient.lisa import LisaOptimizer, lisa_optimizer

if TYPE_CHECKING:
    from typing import TypeAlias

    from essa.gradient.policy import Policy

    Optimizer: TypeAlias = torch.optim.Optimizer | LisaOptimizer


def make_optimizer(
    policy: Policy, section: GRPOConfig | DPOConfig, seed: int, key: str
) -> Optimizer:
    """AdamW over the policy's trainables, or LISA's AdamW that owns its layer groups.

    ``section`` is the recipe's config section (``trainable``, ``lr``, ``weight_decay``,
    ``lisa``); ``key`` names it in error messages ("grpo", "dpo").
    """
    if section.trainable != "lisa":
        return torch.optim.AdamW(policy.params, lr=section.lr, weight_decay=section.weight_decay)
    return lisa_optimizer(
        policy.model, section.lisa, seed, section.lr, section.weight_decay, f"{key}.lisa"
    )
