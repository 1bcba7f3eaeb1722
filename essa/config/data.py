"""The task: sections ``data`` (with GRESO prompt selection and tiered hints) and ``reward``,
with their range checks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from essa.config.errors import ConfigError


@dataclass(frozen=True)
class SelectionConfig:
    """GRESO (arXiv 2506.02177): skip prompts whose recent visits had zero reward spread."""

    name: Literal["none", "greso"] = "none"  # none: every drawn prompt is generated
    explore_init: float = 0.5  # base exploration rate p (easy and hard) at the start
    explore_min: float = 0.05  # p stays in [explore_min, explore_max]
    explore_max: float = 0.95
    explore_step: float = 0.01  # p moves this much per step toward the target ratio
    explore_floor: float = 0.01  # a streak's prompt is always kept with at least this chance
    target_zero_spread: float = 0.25  # zero-spread share aimed at (1/3 easy, 2/3 hard)


@dataclass(frozen=True)
class HintConfig:
    """Scaf-GRPO tiered hints: reference-solution prefixes on prompts that stay at zero reward."""

    after: int | None = None  # consecutive zero-reward visits before the first hint; None: off
    tiers: int = 3  # tier t of T shows floor(n*t/(T+1)) of the solution's n lines/words/chars
    format: str = "{question}\nHint: {hint}"  # the hinted question, before the template


@dataclass(frozen=True)
class DataConfig:
    source: str = (
        "builtin:arithmetic"  # builtin:NAME, a local .jsonl/.json/.csv/.parquet, or a hub id
    )
    question_field: str = "question"
    answer_field: str = "answer"
    solution_field: str | None = None  # full reference solution for SFT (default: the answer)
    split: str | None = None  # hub datasets only
    # Prompt template (auto, raw, chat, qwen_math_cot, qwen_boxed, essa_math, r1); auto: the
    # tokenizer's chat template when it has one, else raw (the demo's tokenizer has none).
    template: str = "auto"
    system_prompt: str | None = None  # template chat only: a system turn before the question
    params: dict[str, Any] = field(default_factory=dict)  # reasoning_gym:TASK: the task's config
    sft_size: int = 1000  # training examples reserved for the SFT stage
    test_size: int = 1000  # held-out examples (builtin tasks have a fixed split)
    # Validation examples, cut after SFT's and before the training pool: the search's checks
    # and the choice of the exported point read them (docs/signal.md). None: the smaller of 256
    # and a quarter of what SFT leaves; 0: none (the run exports the search's mean unchecked).
    val_size: int | None = None
    # Training pool: only the first N examples after the SFT cut (None: all). A small pool is
    # revisited, which the per-prompt histories of data.selection and data.hints need.
    train_size: int | None = None
    batch_size: int = 64  # prompts per generation, shared by all candidates
    selection: SelectionConfig = field(default_factory=SelectionConfig)  # training prompts only
    hints: HintConfig = field(default_factory=HintConfig)  # training prompts only, never held-out
    # algorithm: scalebio only: the training mixture, name -> local file or builtin:NAME (its
    # training pool); data.source then gives the validation (sft split) and held-out examples.
    sources: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardConfig:
    name: str = "math_accuracy"  # a registered reward or module:function
    params: dict[str, Any] = field(default_factory=dict)
    # Wall-clock bound per call of a custom (module:function) reward; a call that misses it
    # scores None for its items (NaN fitness). Built-in rewards bound themselves. null: no bound.
    timeout_seconds: float | None = 60.0
    # ESSA, HF backend: a dense tie-breaker added to the fitness, w * (mean over prompts of the
    # reference answer's mean token log-prob under the candidate), teacher-forced in the
    # generation's own prefill. 0: off. Correctness moves in steps of 1/batch; this does not.
    reference_weight: float = 0.0
    # What the tie-breaker reads per reference token: its log-prob (likelihood), or its margin
    # to the greedy choice, log p(y*_t) - max_v log p(v) (margin: 0 where greedy writes y*_t,
    # so only items greedy gets wrong, by how far they are from flipping, move it).
    reference_signal: Literal["likelihood", "margin"] = "likelihood"
    # Where the scale baseline runs (optimizer.start: scale_baseline): check the tie-breaker
    # against the reward on the scaled factors, and search without it (weight 0) when the
    # fitness with it picks factors the reward rates lower than the reward alone does,
    # cross-validated over the prompts (essa.es.start.reference_check).
    reference_check: bool = True


def check_data(d: DataConfig) -> None:
    if d.batch_size <= 0:
        raise ConfigError(f"data.batch_size: must be > 0, got {d.batch_size}")
    for key, value in (("data.test_size", d.test_size), ("data.sft_size", d.sft_size)):
        if value < 0:
            raise ConfigError(f"{key}: must be >= 0, got {value}")
    if d.train_size is not None and d.train_size < 1:
        raise ConfigError(f"data.train_size: must be >= 1 or null, got {d.train_size}")
    if d.val_size is not None and d.val_size < 0:
        raise ConfigError(f"data.val_size: must be >= 0 or null, got {d.val_size}")
    _check_informative(d.selection, d.hints)
    if d.system_prompt is not None and d.template not in ("chat", "auto"):
        raise ConfigError(
            f"data.system_prompt: applies to template chat only; template {d.template} has "
            "its own fixed prompt"
        )
    if d.params and not d.source.startswith("reasoning_gym:"):
        raise ConfigError(
            f"data.params: only reasoning_gym:TASK sources take parameters, not {d.source}"
        )


def _check_informative(s: SelectionConfig, h: HintConfig) -> None:
    for key in ("explore_min", "explore_init", "explore_max"):
        if not 0.0 < getattr(s, key) <= 1.0:
            raise ConfigError(f"data.selection.{key}: must be in (0, 1], got {getattr(s, key)}")
    if not s.explore_min <= s.explore_init <= s.explore_max:
        raise ConfigError(
            "data.selection: need 0 < explore_min <= explore_init <= explore_max <= 1, got "
            f"{s.explore_min}, {s.explore_init}, {s.explore_max}"
        )
    for key, value in (
        ("explore_step", s.explore_step),
        ("explore_floor", s.explore_floor),
        ("target_zero_spread", s.target_zero_spread),
    ):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"data.selection.{key}: must be in [0, 1], got {value}")
    if h.after is not None and h.after < 1:
        raise ConfigError(f"data.hints.after: must be >= 1 (or null: no hints), got {h.after}")
    if h.tiers < 1:
        raise ConfigError(f"data.hints.tiers: must be >= 1, got {h.tiers}")
    try:
        shown = h.format.format(question="\0", hint="\1")
    except (KeyError, IndexError, ValueError) as err:
        raise ConfigError(
            f"data.hints.format: {h.format!r} must use only {{question}} and {{hint}} ({err})"
        ) from None
    if "\0" not in shown or "\1" not in shown:
        raise ConfigError(f"data.hints.format: {h.format!r} must contain {{question}} and {{hint}}")


def check_reward(r: RewardConfig) -> None:
    if r.timeout_seconds is not None and not r.timeout_seconds > 0:
        raise ConfigError(f"reward.timeout_seconds: must be > 0, got {r.timeout_seconds}")
    w = r.reference_weight
    if not math.isfinite(w) or w < 0:
        raise ConfigError(f"reward.reference_weight: must be a finite number >= 0, got {w}")
