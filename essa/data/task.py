"""A task's splits and its prompts rendered in the configured template."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from essa import seeding
from essa.config import DataConfig, ModelConfig
from essa.errors import UserError
from essa.types import Example

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Task:
    sft: list[Example]  # the SFT stage's examples (disjoint from train and test)
    train: list[Example]  # ESSA draws its per-generation mini-batches from here
    test: list[Example]  # held-out; never used for any choice made during training
    # Validation: the checks during the search and the choice of what is exported read it
    # (essa.es.watch); disjoint from the other three.
    val: list[Example] = dataclasses.field(default_factory=list)


def load_task(cfg: DataConfig, seed: int) -> Task:
    """Split the data deterministically into SFT, train and held-out test examples."""
    from essa.data import load_examples
    from essa.data.loaders import builtin_examples
    from essa.data.templates import known_templates

    if cfg.template not in known_templates():  # fail before any data or model is loaded
        raise UserError(
            f"data.template: unknown prompt template {cfg.template!r}; "
            f"known: {', '.join(known_templates())}"
        )

    if cfg.source.startswith("builtin:"):
        pool, fixed_test = builtin_examples(cfg.source)  # a fixed held-out set per task
        test = fixed_test[: cfg.test_size]
    else:
        examples = load_examples(
            cfg.source,
            question_field=cfg.question_field,
            answer_field=cfg.answer_field,
            solution_field=cfg.solution_field,
            split=cfg.split,
            params=cfg.params,
        )
        order = seeding.rng(seed, "data.test_split").permutation(len(examples))
        shuffled = [examples[i] for i in order]
        test, pool = shuffled[: cfg.test_size], shuffled[cfg.test_size :]
    # The SFT/train cut depends on the run seed: one SFT adapter per (task, seed).
    order = seeding.rng(seed, "data.sft_split").permutation(len(pool))
    pool = [pool[i] for i in order]
    sft, rest = pool[: cfg.sft_size], pool[cfg.sft_size :]
    n_val = val_items(cfg.val_size, len(rest))
    val, train = rest[:n_val], rest[n_val:][: cfg.train_size]
    if not train:
        raise UserError(
            f"data.source {cfg.source}: no training examples left after the "
            f"test ({cfg.test_size}) and SFT ({cfg.sft_size}) splits"
        )
    return Task(sft=sft, train=train, test=test, val=val)


VAL_ITEMS = 256  # the automatic validation split's size at most (a quarter of a small pool)


def val_items(val_size: int | None, pool: int) -> int:
    """The validation split's size: ``data.val_size``, or (None) the smaller of
    :data:`VAL_ITEMS` and a quarter of what SFT leaves, so a small pool keeps most for training.

    >>> val_items(None, 1300), val_items(None, 100), val_items(50, 1300)
    (256, 25, 50)
    """
    return min(VAL_ITEMS, pool // 4) if val_size is None else min(val_size, pool)


def render_prompts(
    examples: Sequence[Example], template: str, tokenizer: Any, system_prompt: str | None = None
) -> list[str]:
    from essa.data.templates import render_prompts as render

    try:
        return render(template, [ex.prompt for ex in examples], tokenizer, system_prompt)
    except ValueError as err:
        raise UserError(f"data.template: {err}") from None


def check_prompt_template(d: DataConfig, model: ModelConfig) -> None:
    """Refuse ``data.template`` (and ``data.system_prompt``) when the model's tokenizer cannot
    render it, before the model loads: the tokenizer alone loads in about a second, a GGUF not
    converted yet is read for its header only. A real tokenizer renders one question, so that a
    chat template that fails on its own (e.g. no system role) is caught here too."""
    from essa.backends.models import template_tokenizer
    from essa.data.templates import check_template, render_prompt

    tokenizer = template_tokenizer(model)
    try:
        check_template(d.template, tokenizer, d.system_prompt)
        if hasattr(tokenizer, "apply_chat_template"):  # a real tokenizer, not a GGUF header
            render_prompt(d.template, "1+1=", tokenizer, d.system_prompt)
    except ValueError as err:
        raise UserError(f"data.template: {err} ({model.name_or_path})") from None


def render_splits(task: Task, data: DataConfig, tokenizer: Any) -> tuple[list[str], list[str]]:
    """(train prompts, test prompts) in ``data.template`` with ``data.system_prompt``."""
    return (
        render_prompts(task.train, data.template, tokenizer, data.system_prompt),
        render_prompts(task.test, data.template, tokenizer, data.system_prompt),
    )
