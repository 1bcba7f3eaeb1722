"""The truncation mask (overlong filtering; DAPO, arXiv 2503.14476 §3.4; spec §5.4a): a variant
with ``use_truncation_mask`` takes no loss on completions that hit ``max_new_tokens`` without
a stop, since their cut-off end says nothing about the answer. In the GRPO step it is a mask
hook (essa/gradient/hooks.py); their rewards still count in their groups' statistics.
"""

from __future__ import annotations

from torch import Tensor

from essa.gradient.hooks import Record
from essa.gradient.policy import Rollout


def truncated_rows(batch: Rollout) -> tuple[Tensor, Record]:
    """The (B,) rows that ended without a stop token; no metrics."""
    return batch.truncated, {}
