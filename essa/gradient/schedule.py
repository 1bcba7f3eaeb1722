"""The learning-rate schedule and gradient clipping: one of each for GRPO, DPO, ScaleBiO, LISA
and the SFT stage."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch

Schedule = Literal["constant", "cosine", "linear"]


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


def set_lr(param_groups: Sequence[dict[str, Any]], lr: float) -> None:
    """Every parameter group's learning rate to ``lr`` (an optimizer's ``param_groups``)."""
    for group in param_groups:
        group["lr"] = lr


def clip_gradients(params: Sequence[torch.Tensor], max_norm: float) -> float:
    """Clip the gradients' global norm to ``max_norm`` (0: no clipping); return the norm before."""
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    grads = [p.grad.flatten() for p in params if p.grad is not None]
    return float(torch.cat(grads).norm()) if grads else 0.0
