"""heldout_scores.jsonl: every held-out pass's per-item scores, one record format for all
recipes (paired tests against the SFT adapter need no second evaluation)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

HELDOUT_SCORES_NAME = "heldout_scores.jsonl"
HELDOUT_RECORD_KEYS = ("generation", "final", "metric", "pass", "scores")


def heldout_record(
    generation: int, final: bool, metric: str, name: str, scores: Sequence[float]
) -> dict[str, Any]:
    """One record of heldout_scores.jsonl (keys :data:`HELDOUT_RECORD_KEYS`)."""
    values = (generation, final, metric, name, [float(s) for s in scores])
    return dict(zip(HELDOUT_RECORD_KEYS, values, strict=True))
