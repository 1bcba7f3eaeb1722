"""Informative prompts in the GRPO step (``data.selection`` / ``data.hints``): a sampling hook
(essa/gradient/hooks.py) around the per-prompt tracker of essa/data/selection.py.

sample_groups draws through the tracker (GRESO's skips, Scaf-GRPO's hints) and feeds it each
group's rewards; after the step's sampling the hook logs the step's counts and writes the
tracker's history into the run state, so a resumed run skips and hints exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from essa.config import DataConfig
from essa.data.selection import Informative, informative_prompts
from essa.gradient.replay import Experience


@dataclass(frozen=True)
class InformativePrompts:
    """The tracker sample_groups consults; :meth:`end` is the sampling hook."""

    prompts: Informative

    @classmethod
    def build(
        cls, data: DataConfig, seed: int, group_size: int, tokenizer: Any, state: dict[str, Any]
    ) -> InformativePrompts | None:
        """The hook when ``data.selection`` or ``data.hints`` is on (None when both are off),
        its history read from the run state (empty on a fresh run)."""
        tracker = informative_prompts(data, seed, group_size, tokenizer, state.get("informative"))
        return None if tracker is None else cls(tracker)

    def end(
        self,
        replays: Sequence[Sequence[Experience]],
        found: Sequence[Experience],
        state: dict[str, Any],
    ) -> dict[str, Any]:
        """prompts_skipped, rows_saved, prompts_hinted, ...; the history into ``state``."""
        record: dict[str, Any] = dict(self.prompts.end_step())
        state["informative"] = self.prompts.state_dict()
        return record
