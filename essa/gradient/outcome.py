"""The GRPO step's outcome advantages: the variant's group-normalised advantages of each kept
group's rewards (essa/gradient/losses.py), one per row of the training batch. The advantage
hooks (essa/gradient/hooks.py) start from these.
"""

from __future__ import annotations

from typing import Any

from essa.gradient import losses
from essa.gradient.hooks import RowAdvantages, StepBatch


def outcome_advantages(
    variant: losses.Variant, rows: StepBatch, state: dict[str, Any]
) -> RowAdvantages:
    """Each row's advantage and keep flag, both (B,), read at its (group, slot) of the (N, G + k)
    group advantages. DCPO's per-prompt history is read from and written to ``state``."""
    history = losses.history_from_json(state["history"])
    adv, history = losses.advantages(variant, rows.rewards, rows.prompt_ids, history)
    state["history"] = losses.history_to_json(history)
    at = (rows.group_index, rows.slot)
    return RowAdvantages(adv.values[at], adv.keep[at])  # (B,), (B,)
