"""Held-out scoring of a gradient-trained policy: greedy, on the fixed test split, as ESSA's."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from essa.config import GenerationConfig, PythonToolConfig
from essa.tools.turns import ToolTally

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
    tools: PythonToolConfig | None = None,
    tally: ToolTally | None = None,
) -> float:
    """Greedy held-out score (``evaluation.metric``) on ``data.test``; NaN when it is empty.

    With ``step`` its first items are also samples (:meth:`Harness.score`). It never feeds back
    into training. With ``tools`` (``max_tool_calls`` > 0) the rows call the Python tool as
    the rollouts do (essa.backends.tool_turns), and their tool use goes to ``tally``.
    """
    from essa.backends.evaluator import heldout_completions

    if not data.test:
        return float("nan")
    greedy = replace(generation, temperature=0.0)  # the groups sample; the score is greedy
    with policy.inference(), h.phase(name, len(data.test), unit="rows") as bar:
        if tools is not None and tools.max_tool_calls:
            texts = _with_tools(policy, tokenizer, data, greedy, micro_batch_size, tools, tally,
                                bar.advance)  # fmt: skip
        else:
            texts, _ = heldout_completions(  # the path ESSA's and `essa eval`'s scores take
                policy.model, tokenizer, data.test_prompts, greedy,
                micro_batch_size=micro_batch_size, progress=bar.advance,
            )  # fmt: skip
    return h.score(texts, data.test, data.test_prompts, step, final=final, name=name)


def _with_tools(
    policy: Policy,
    tokenizer: Any,
    data: TaskData,
    greedy: GenerationConfig,
    micro_batch_size: int,
    tools: PythonToolConfig,
    tally: ToolTally | None,
    progress: Any,
) -> list[str]:
    from essa.backends.tool_turns import generate_turns
    from essa.rewards.extract import extract_answer

    ids = tokenizer(list(data.test_prompts), add_special_tokens=False)["input_ids"]
    texts, _, transcripts = generate_turns(
        policy.model, tokenizer, ids, greedy, tools, micro_batch_size=micro_batch_size,
        progress=progress,
    )  # fmt: skip
    if tally is not None:
        tally.add(
            transcripts, [extract_answer(t.turns[-1]) if t.turns else None for t in transcripts]
        )
    return texts


def baseline_state(
    policy: Policy,
    tokenizer: Any,
    data: TaskData,
    h: Harness,
    generation: GenerationConfig,
    micro_batch_size: int,
    fields: dict[str, Any],
    tools: PythonToolConfig | None = None,
) -> dict[str, Any]:
    """A fresh run's state, after metrics.jsonl's baseline record (the starting policy's
    held-out score, with ``fields``)."""
    score = heldout_accuracy(
        policy, tokenizer, data, h, generation, micro_batch_size, "held-out baseline", -1,
        tools=tools,
    )  # fmt: skip
    h.log({"generation": -1, "event": "baseline", "heldout_accuracy": score, **fields})
    return {"step": 0, "baseline_accuracy": score, "elapsed": 0.0}
