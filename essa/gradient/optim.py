"""The optimizer side of every gradient recipe: AdamW (plain or LISA's), the learning-rate
schedule and gradient clipping, one of each for GRPO, DPO, ScaleBiO and the SFT stage."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from essa.config import DPOConfig, GRPOConfig, LisaConfig

if TYPE_CHECKING:
    from typing import TypeAlias

    from essa.gradient.lisa import LisaOptimizer
    from essa.gradient.policy import Policy

    Optimizer: TypeAlias = torch.optim.Optimizer | LisaOptimizer

Schedule = Literal["constant", "cosine", "linear"]


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


def lisa_optimizer(
    model: Any, lisa: LisaConfig, seed: int, lr: float, weight_decay: float, key: str
) -> LisaOptimizer:
    """:class:`LisaOptimizer` on ``model`` with the ``lisa`` section's layer schedule."""
    from essa.gradient.lisa import LisaOptimizer

    return LisaOptimizer(
        model,
        active_layers=lisa.active_layers,
        interval=lisa.interval,
        seed=seed,
        lr=lr,
        weight_decay=weight_decay,
        train_embeddings=lisa.train_embeddings,
        train_head=lisa.train_head,
        config_key=key,
    )


def lr_factor(step: int, total: int, warmup: int = 0, schedule: Schedule = "cosine") -> float:
    """The learning-rate factor of ``step`` in ``total``: linear warm-up over ``warmup`` steps,
    then constant, cosine to 0 or linear to 0 over the rest.

    >>> [round(lr_factor(s, 10, warmup=2), 3) for s in (0, 1, 2, 6, 10)]
    [0.5, 1.0, 1.0, 0.5, 0.0]
    """
    if step < warmup:
        return (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * frac))
    if schedule == "linear":
        return 1.0 - frac
    return 1.0


def clip_gradients(params: Sequence[torch.Tensor], max_norm: float) -> float:
    """Clip the gradients' global norm to ``max_norm`` (0: no clipping); return the norm before."""
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    grads = [p.grad.flatten() for p in params if p.grad is not None]
    return float(torch.cat(grads).norm()) if grads else 0.0
