"""The reference tie-breaker's targets (``reward.reference_weight``), one per training item.

Without tool calls the tie-breaker reads each item's answer. With tool calls
(``tools.python``, SFT on code-call targets) a tool-using model is not expected to write the
bare answer after the prompt, so each item's code-call target is its reference instead
(essa.data.tool_sft.tool_references).
"""

from __future__ import annotations

from essa.config import PythonToolConfig, RewardConfig
from essa.types import Example


def search_references(
    tools: PythonToolConfig, reward: RewardConfig, train: list[Example]
) -> list[str | None] | None:
    """The search's references: with tool calls and the tie-breaker, each training item's
    code-call target; None: the answers, as without tools."""
    if not (tools.max_tool_calls and tools.sft_with_code and reward.reference_weight):
        return None
    from essa.data.tool_sft import tool_references

    return tool_references(train, tools)


def check_references(
    tools: PythonToolConfig, reward: RewardConfig, train: list[Example]
) -> list[str | None] | None:
    """The references the scale baseline checks the tie-breaker on against the reward
    (``reward.reference_check``); None: no tie-breaker, or no check."""
    if not (reward.reference_weight and reward.reference_check):
        return None
    return search_references(tools, reward, train) or [ex.answer for ex in train]
