"""The gradient recipes' prompts: a task's training and held-out examples with their rendered
prompts, and the seeded draw of a step's training prompts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from essa import seeding
from essa.config import DataConfig
from essa.types import Example

if TYPE_CHECKING:
    from essa.data.task import Task


@dataclass(frozen=True)
class TaskData:
    """Training examples and their prompts (``data.template``); the fixed held-out split too."""

    train: list[Example]
    train_prompts: list[str]
    test: list[Example]
    test_prompts: list[str]

    @classmethod
    def build(
        cls, task: Task, data: DataConfig, tokenizer: Any, train_examples: int | None = None
    ) -> TaskData:
        """``train_examples``: only the first N training prompts (1-shot RLVR: 1)."""
        from essa.data.task import render_splits

        train_prompts, test_prompts = render_splits(task, data, tokenizer)
        n = train_examples
        return cls(task.train[:n], train_prompts[:n], task.test, test_prompts)

    @classmethod
    def heldout(cls, task: Task, data: DataConfig, tokenizer: Any) -> TaskData:
        """The held-out split only (a recipe that trains on other data)."""
        from essa.data.task import render_prompts

        test_prompts = render_prompts(task.test, data.template, tokenizer, data.system_prompt)
        return cls([], [], task.test, test_prompts)


def draw(size: int, count: int, seed: int, stream: str, *keys: int) -> list[int]:
    """``count`` indices of ``size`` without replacement (all of them when fewer), seeded by
    (seed, stream, keys): a pure function of the step, so a resumed run draws the same."""
    rng = seeding.rng(seed, stream, *keys)
    return rng.choice(size, size=min(count, size), replace=False).tolist()
