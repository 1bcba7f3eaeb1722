"""Informative prompts: GRESO's pre-rollout skipping and Scaf-GRPO's tiered hints.

Both rules read one per-prompt history of reward spread, kept by :class:`Informative` for the
ESSA recipe (spread across the population's candidates of the generation's shared prompt) and
the GRPO recipe (spread across the G completions of the prompt's group). numpy only; the
recipes do the generating. Formulas, defaults and deviations: docs/informative-prompts.md.

* **GRESO** (arXiv 2506.02177, "Act Only When It Pays"): a prompt whose latest z
  visits all had zero spread is skipped before generation with probability
  ``1 - max(p**z, floor)``; p (one for easy, one for hard prompts) moves by ``explore_step``
  toward a target zero-spread ratio after every step. The batch is refilled from the next
  prompts so it keeps its configured size.
* **Scaf-GRPO** (tiered in-prompt hints): a prompt on which no completion scored above 0 for
  ``after`` consecutive visits gets, for its next visit only, a prefix of its reference
  solution in the prompt; a longer prefix (the next tier) on each later failing visit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from essa import seeding
from essa.config import DataConfig, HintConfig, SelectionConfig
from essa.types import Example

Render = Callable[[list[Example]], list[str]]  # questions -> model input text (the template)


@dataclass(frozen=True)
class PromptRecord:
    """One prompt's streaks over its latest visits (GRESO's trace reduced to what its rule reads)."""

    visits: int = 0
    easy: int = 0  # latest consecutive visits with zero spread and a common reward > 0
    hard: int = 0  # latest consecutive visits with zero spread and a common reward <= 0
    zero: int = 0  # latest consecutive visits on which no completion scored above 0 (hints)


def visit_kind(values: np.ndarray) -> str | None:
    """``"easy"`` / ``"hard"`` for a zero-spread visit (all rewards equal, > 0 / <= 0),
    ``"informative"`` otherwise; None when no value is finite (a failed visit, not recorded).

    >>> visit_kind(np.array([1.0, 1.0])), visit_kind(np.array([0.0, np.nan])), visit_kind(np.array([0.0, 1.0]))
    ('easy', 'hard', 'informative')
    """
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return None
    if finite.max() != finite.min():
        return "informative"
    return "easy" if finite[0] > 0 else "hard"


def update(record: PromptRecord, values: np.ndarray) -> PromptRecord:
    """The record after one visit with rewards ``values`` (R,) (NaN: an ungradable one)."""
    kind = visit_kind(values)
    if kind is None:
        return record
    finite = values[np.isfinite(values)]
    return PromptRecord(
        visits=record.visits + 1,
        easy=record.easy + 1 if kind == "easy" else 0,
        hard=record.hard + 1 if kind == "hard" else 0,
        zero=record.zero + 1 if finite.max() <= 0 else 0,
    )


def skip_probability(record: PromptRecord, p_easy: float, p_hard: float, floor: float) -> float:
    """GRESO: ``1 - max(p**z, floor)`` with the easy streak checked first; 0 without a streak.

    >>> round(skip_probability(PromptRecord(3, easy=3), 0.5, 0.5, 0.01), 6)
    0.875
    """
    if record.easy > 0:
        return 1.0 - max(p_easy**record.easy, floor)
    if record.hard > 0:
        return 1.0 - max(p_hard**record.hard, floor)
    return 0.0


def adapt_rate(p: float, observed: float, target: float, cfg: SelectionConfig) -> float:
    """GRESO's base exploration rate after a step: down by one step when the observed
    zero-spread ratio is at or above the target (skip more), up otherwise, within bounds.
    Rounded to 12 decimals so repeated steps of 0.01 read as 0.46, not 0.45999999999999996."""
    p = p - cfg.explore_step if observed >= target else p + cfg.explore_step
    return round(min(max(p, cfg.explore_min), cfg.explore_max), 12)


def choose(
    order: Sequence[int], size: int, skip: Sequence[float], uniforms: np.ndarray
) -> tuple[list[int], list[int]]:
    """(kept, skipped): walk ``order`` keeping prompt ``order[j]`` unless ``uniforms[j] <
    skip[j]``, until ``size`` are kept; if the walk ends short, the first skipped are taken
    back in order, so the batch always has ``min(size, len(order))`` prompts."""
    kept: list[int] = []
    skipped: list[int] = []
    for j, index in enumerate(order):
        if len(kept) == size:
            break
        (skipped if uniforms[j] < skip[j] else kept).append(int(index))
    short = size - len(kept)
    if short > 0:
        kept, skipped = kept + skipped[:short], skipped[short:]
    return kept, skipped


def hint_tier(zero_streak: int, cfg: HintConfig) -> int:
    """0 (no hint) before ``after`` zero-reward visits in a row; then 1, 2, ... up to ``tiers``.

    >>> [hint_tier(z, HintConfig(after=2, tiers=2)) for z in range(5)]
    [0, 0, 1, 2, 2]
    """
    if cfg.after is None or zero_streak < cfg.after:
        return 0
    return min(zero_streak - cfg.after + 1, cfg.tiers)


def hint_text(reference: str, tier: int, tiers: int) -> str:
    """Tier ``tier`` of ``tiers``: the first ``floor(n * tier / (tiers + 1))`` of the reference's
    n units (lines if it has several, else words if several, else characters), at least one
    and never all of them ("" for a one-unit reference: nothing to hint without the answer).

    >>> hint_text("a\\nb\\nc\\nd", 1, 3), hint_text("12 + 35 = 47", 3, 3), hint_text("47", 1, 3)
    ('a', '12 + 35', '4')
    """
    text = reference.strip()
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) > 1:
        units, sep = lines, "\n"
    elif len(text.split()) > 1:
        units, sep = text.split(), " "
    else:
        units, sep = list(text), ""
    n = len(units)
    shown = min(n - 1, max(1, math.floor(n * tier / (tiers + 1))))
    return sep.join(units[:shown]) if shown > 0 else ""


class Informative:
    """The run's per-prompt history and both rules over it; :meth:`state_dict` is checkpointed.

    Per step: :meth:`draw` the batch (skipping), :meth:`prompts` (hinting), :meth:`observe`
    the rewards, :meth:`end_step` for the metrics (and GRESO's adaptation).
    """

    def __init__(
        self,
        data: DataConfig,
        seed: int,
        rows_per_prompt: int,
        render: Render,
        state: dict[str, Any] | None = None,
    ) -> None:
        self.selection, self.hints = data.selection, data.hints
        self.seed = seed
        self.rows_per_prompt = rows_per_prompt  # generated rows a skipped prompt would cost
        self.render = render
        state = state or {}
        self.p_easy = float(state.get("p_easy", self.selection.explore_init))
        self.p_hard = float(state.get("p_hard", self.selection.explore_init))
        self.records = {int(k): PromptRecord(*v) for k, v in state.get("prompts", {}).items()}
        self._reset_counts()

    @classmethod
    def build(
        cls,
        data: DataConfig,
        seed: int,
        rows_per_prompt: int,
        render: Render,
        state: dict[str, Any] | None = None,
    ) -> Informative | None:
        """The tracker when ``data.selection`` or ``data.hints`` is on, else None."""
        if data.selection.name == "none" and data.hints.after is None:
            return None
        return cls(data, seed, rows_per_prompt, render, state)

    def _reset_counts(self) -> None:
        self.counts = {"skipped": 0, "hinted": 0, "visited": 0, "easy": 0, "hard": 0}

    def record(self, index: int) -> PromptRecord:
        return self.records.get(index, PromptRecord())

    def draw(self, first: Sequence[int], pool_size: int, key: Sequence[int]) -> list[int]:
        """The step's prompt indices: ``first`` (the recipe's own draw) with GRESO's skips,
        refilled from the rest of the pool in an order fixed by (seed, key); ``first`` itself
        when selection is off. A pure function of the history and (seed, key): exact on resume."""
        if self.selection.name == "none":
            return list(first)
        rng = seeding.rng(self.seed, "selection.refill", *key)
        taken = set(first)
        rest = rng.permutation([i for i in range(pool_size) if i not in taken]).tolist()
        order = [*first, *rest]
        floor = self.selection.explore_floor
        skip = [  # a prompt without a record is never skipped (most of a large pool)
            skip_probability(self.records[i], self.p_easy, self.p_hard, floor)
            if i in self.records
            else 0.0
            for i in order
        ]
        kept, skipped = choose(order, len(first), skip, rng.random(len(order)))
        self.counts["skipped"] += len(skipped)
        return kept

    def prompts(
        self, indices: Sequence[int], examples: Sequence[Example], rendered: Sequence[str]
    ) -> list[str]:
        """The model inputs of ``indices``: ``rendered[i]``, or the question with its tier's
        hint rendered through the template. Only training prompts come here: held-out ones
        never see a hint."""
        out = []
        for i in indices:
            tier = hint_tier(self.record(i).zero, self.hints)
            example = examples[i]
            reference = example.solution if example.solution is not None else example.answer
            hint = hint_text(reference, tier, self.hints.tiers) if tier and reference else ""
            if not hint:
                out.append(rendered[i])
                continue
            question = self.hints.format.format(question=example.prompt, hint=hint)
            out.extend(self.render([replace(example, prompt=question)]))
            self.counts["hinted"] += 1
        return out

    def observe(self, indices: Sequence[int], values: np.ndarray) -> None:
        """Record one visit of each prompt: ``values`` (N, R) holds prompt j's R rewards
        (candidates or group samples; NaN where ungradable)."""
        for j, i in enumerate(indices):
            kind = visit_kind(values[j])
            if kind is None:
                continue
            self.counts["visited"] += 1
            if kind in ("easy", "hard"):
                self.counts[kind] += 1
            self.records[int(i)] = update(self.record(int(i)), values[j])

    def end_step(self) -> dict[str, float | int]:
        """The step's metrics; then GRESO moves p toward the target (1/3 easy, 2/3 hard)."""
        c = self.counts
        visited = max(c["visited"], 1)
        metrics: dict[str, float | int] = {
            "zero_spread_fraction": (c["easy"] + c["hard"]) / visited,
        }
        if self.selection.name != "none":
            metrics.update(
                prompts_skipped=c["skipped"],
                rows_saved=c["skipped"] * self.rows_per_prompt,
                explore_easy=self.p_easy,
                explore_hard=self.p_hard,
            )
            if c["visited"]:
                target = self.selection.target_zero_spread
                self.p_easy = adapt_rate(
                    self.p_easy, c["easy"] / visited, target / 3, self.selection
                )
                self.p_hard = adapt_rate(
                    self.p_hard, c["hard"] / visited, target * 2 / 3, self.selection
                )
        if self.hints.after is not None:
            metrics["prompts_hinted"] = c["hinted"]
        self._reset_counts()
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """Plain data for the checkpoint: both rates and every visited prompt's streaks."""
        return {
            "p_easy": self.p_easy,
            "p_hard": self.p_hard,
            "prompts": {
                str(i): [r.visits, r.easy, r.hard, r.zero] for i, r in sorted(self.records.items())
            },
        }


def informative_prompts(
    data: DataConfig,
    seed: int,
    rows_per_prompt: int,
    tokenizer: Any,
    state: dict[str, Any] | None = None,
) -> Informative | None:
    """The per-prompt history of ``data.selection`` / ``data.hints`` for prompts rendered in
    ``data.template`` (None when both are off); ``rows_per_prompt`` is what one visit of a prompt
    generates (ESSA: candidates x samples; GRPO: the group)."""
    from essa.data.task import render_prompts

    def render(examples: list[Example]) -> list[str]:
        return render_prompts(examples, data.template, tokenizer, data.system_prompt)

    return Informative.build(data, seed, rows_per_prompt, render, state)
