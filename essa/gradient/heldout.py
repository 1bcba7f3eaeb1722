"""Held-out scoring of a gradient-trained policy: greedy, on the fixed test split, as ESSA's."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from essa.config import GenerationConfig

if TYPE_CHECKING:
    from essa.gradient.data import TaskData
    from essa.gradient.policy import Policy
    from essa.harness import Harness


def heldout_accuracy(
    policy: Policy,
    tokenizer: Any,
    data: TaskData,
    h: Harness,
    generation: GenerationConfig,
    micro_batch_size: int,
    name: str = "held-out",
    step: int | None = None,
    *,
    final: bool = False,
) -> float:
    """Greedy held-out score (``evaluation.metric``) on ``data.test``; NaN when it is empty.

    With ``step`` its first items are also samples (:meth:`Harness.score`). It never feeds back
    into training.
    """
    from essa.backends.generate import generate_texts

    if not data.test:
        return float("nan")
    with policy.inference(), h.phase(name, len(data.test), unit="rows") as bar:
        texts, _ = generate_texts(
            policy.model,
            tokenizer,
            data.test_prompts,
            replace(generation, temperature=0.0),  # the groups sample; the score is greedy
            micro_batch_size=micro_batch_size,
            progress=bar.advance,
        )
    return h.score(texts, data.test, data.test_prompts, step, final=final)


def baseline_state(
    policy: Policy,
    tokenizer: Any,
    data: TaskData,
    h: Harness,
    generation: GenerationConfig,
    micro_batch_size: int,
    fields: dict[str, Any],
) -> dict[str, Any]:
    """A fresh run's state, after metrics.jsonl's baseline record (the starting policy's
    held-out score, with ``fields``)."""
    score = heldout_accuracy(
        policy, tokenizer, data, h, generation, micro_batch_size, "held-out baseline", -1
    )
    h.log({"generation": -1, "event": "baseline", "heldout_accuracy": score, **fields})
    return {"step": 0, "baseline_accuracy": score, "elapsed": 0.0}
