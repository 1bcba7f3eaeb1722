"""``gym_score``: grade with a reasoning-gym task's own scorer (optional ``[gym]`` extra)."""

from __future__ import annotations

import re
from typing import Any

from essa.rewards.base import RewardStats, ScoreFn
from essa.rewards.extract import extract_answer, strip_markup

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def gym_answer(completion: str) -> str:
    """The answer a reasoning-gym scorer sees: the last ``<answer>...</answer>`` content (less
    Markdown emphasis around all of it), else the box / ``####`` / answer-phrase answer of
    :func:`~essa.rewards.extract.extract_answer` (no last-number fallback), else the stripped
    completion (a bare-answer completion such as ``"46"``).

    >>> gym_answer("<think>x</think><answer> **7** </answer>"), gym_answer(" 46\\n")
    ('7', '46')
    """
    tags = _ANSWER_TAG.findall(completion)
    if tags:
        return strip_markup(tags[-1], whole=True).strip()
    answer = extract_answer(completion, use_last_number=False)
    return answer if answer is not None else completion.strip()


class _EntryIndex:
    """Find the dataset entry of a (possibly template-rendered) prompt: the exact question,
    else the longest question contained in the prompt; None if none is."""

    def __init__(self, entries: list[dict[str, Any]]) -> None:
        self._by_question = {str(entry["question"]): entry for entry in entries}
        self._longest_first = sorted(self._by_question, key=len, reverse=True)
        self._cache: dict[str, dict[str, Any] | None] = {}

    def find(self, prompt: str) -> dict[str, Any] | None:
        if prompt in self._by_question:
            return self._by_question[prompt]
        if prompt not in self._cache:
            question = next((q for q in self._longest_first if q in prompt), None)
            self._cache[prompt] = None if question is None else self._by_question[question]
        return self._cache[prompt]


def gym_score(
    stats: RewardStats,
    *,
    task: str,
    size: int | None = None,
    seed: int | None = None,
    params: dict[str, Any] | None = None,
) -> ScoreFn:
    """Score with reasoning-gym's own ``score_answer`` for ``task``.

    ``R_i = dataset.score_answer(gym_answer(completion_i), entry_i)`` (1.0 correct, 0.0 to 0.01
    otherwise, per the task), where ``entry_i`` is the dataset entry whose question is
    ``prompts[i]`` (or is contained in it, when a template wrapped the question). The dataset is
    regenerated with the ``reasoning_gym:TASK`` source's ``size`` and ``seed``
    (:mod:`essa.sources`) and its ``data.params`` (``params``); change them only together.
    None for a prompt of no entry.
    """
    from essa.sources import GYM_SEED, GYM_SIZE, gym_dataset

    seed = GYM_SEED if seed is None else seed
    dataset = gym_dataset(task, size=size or GYM_SIZE, seed=seed, params=params)
    index = _EntryIndex(list(dataset))

    def score(
        completions: list[str], answers: list[str | None], prompts: list[str]
    ) -> list[float | None]:
        scores: list[float | None] = []
        for completion, prompt in zip(completions, prompts, strict=True):
            entry = index.find(prompt)
            if entry is None:
                scores.append(None)
            else:
                scores.append(float(dataset.score_answer(gym_answer(completion), entry)))
        return scores

    return score
