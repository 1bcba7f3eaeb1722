"""The GRPO family's presets, one entry per variant: the table ``grpo.loss`` names.

Adding a variant is one :class:`Variant` in :data:`VARIANTS`: the config takes its name as a
``grpo.loss`` value (essa/config/gradient.py reads this table) and the losses in
:mod:`essa.gradient.losses` read its fields. Plain data, no torch, and nothing of essa imported:
the config (the bottom layer) checks its names without loading the numeric stack or depending
on the gradient toolkit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Normaliser = Literal["sequence_mean", "token_mean", "constant_length", "group_token_mean"]
GroupFilter = Literal["none", "mixed", "not_all_max"]

TRL_EPS_STD = 1e-4  # TRL grpo_trainer: (r - mean) / (std + 1e-4)
VERL_EPS_STD = 1e-6  # verl compute_grpo_outcome_advantage, NGRPO, DCPO


AdvantageKind = Literal["std", "centered", "ngrpo", "w_reinforce", "psr", "nsr", "smooth"]


@dataclass(frozen=True)
class Variant:
    """One GRPO-family preset; the recipe logs it with the run (spec §11)."""

    name: str
    advantage: AdvantageKind
    eps_std: float  # ε added to the std (TRL 1e-4, verl 1e-6); unused without std division
    normaliser: Normaliser
    epsilon_low: float  # ratio lower bound 1 − ε_low (DCPO: ε in its bound formula)
    epsilon_high: float
    beta: float  # KL k3 coefficient
    dual_clip: float | None  # c for Â < 0 (verl clip_ratio_c); None = off
    group_filter: GroupFilter  # dynamic sampling: which groups are resampled away
    use_truncation_mask: bool  # overlong filtering: no loss on completions without EOS
    use_dynamic_clip: bool  # DCPO's probability-dependent bounds
    positive_weight: float = 0.1  # W-REINFORCE λ
    source: str = ""


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("grpo", "std", TRL_EPS_STD, "sequence_mean", 0.2, 0.2, 0.04, None, "none",
                False, False, source="DeepSeekMath; TRL v0.14 grpo_trainer.py (spec §2)"),
        Variant("dr_grpo", "centered", 0.0, "constant_length", 0.2, 0.2, 0.0, None, "none",
                False, False, source="arXiv 2503.20783; TRL loss_type=dr_grpo (spec §4)"),
        Variant("dapo", "std", VERL_EPS_STD, "token_mean", 0.2, 0.28, 0.0, None, "mixed",
                True, False, source="arXiv 2503.14476 §2-4; TRL loss_type=dapo (spec §5)"),
        Variant("ngrpo", "ngrpo", VERL_EPS_STD, "token_mean", 0.16, 0.24, 0.0, 3.0,
                "not_all_max", False, False, source="arXiv 2509.18851; NGRPO core_algos (§7)"),
        Variant("w_reinforce", "w_reinforce", 0.0, "token_mean", 0.2, 0.2, 0.0, 3.0, "none",
                False, False, source="arXiv 2506.01347; RLVR-Decomposed (spec §9)"),
        Variant("psr", "psr", 0.0, "token_mean", 0.2, 0.2, 0.0, 3.0, "none", False, False,
                source="arXiv 2506.01347 (spec §9)"),
        Variant("nsr", "nsr", 0.0, "token_mean", 0.2, 0.2, 0.0, 3.0, "none", False, False,
                source="arXiv 2506.01347 (spec §9)"),
        Variant("dcpo", "smooth", VERL_EPS_STD, "group_token_mean", 0.2, 0.28, 0.0, 10.0,
                "none", False, True, source="arXiv 2509.02333; lime-RL/DCPO (spec §8)"),
    )
}  # fmt: skip


def get_variant(name: str) -> Variant:
    """The preset named ``name``; a ValueError names the known ones."""
    if name not in VARIANTS:
        raise ValueError(f"unknown GRPO variant {name!r} (known: {', '.join(VARIANTS)})")
    return VARIANTS[name]
