"""The GRPO step's optional features, read from the config and each put on its hook
(essa/gradient/hooks.py); with every feature off the hooks are empty and the step is plain GRPO.

* what is sampled: informative prompts (``data.selection`` / ``data.hints``,
  essa/gradient/informative.py) and RLEP replay (``grpo.replay``, essa/gradient/replay.py);
* how advantages are made: PRM step credit (``grpo.prm_credit: step``,
  essa/gradient/prm_credit.py), then PRIME (``grpo.prime``, essa/gradient/prime.py);
* what the loss masks: the variant's truncation mask (essa/gradient/truncation.py), then
  SimpleTIR's void turns (``tools.python.drop_void_turns``, essa/gradient/tool_rollout.py).
"""

from __future__ import annotations

from typing import Any

from essa.config import DataConfig, GRPOConfig, PythonToolConfig
from essa.gradient import losses
from essa.gradient.hooks import AdvantageHook, Hooks, MaskHook
from essa.gradient.informative import InformativePrompts
from essa.gradient.policy import Policy
from essa.gradient.prime import ImplicitPRM, ProcessAdvantages
from essa.gradient.prm_credit import step_credit_advantages
from essa.gradient.replay import Replay
from essa.gradient.tool_rollout import void_rows
from essa.gradient.truncation import truncated_rows


def grpo_hooks(
    g: GRPOConfig,
    data: DataConfig,
    tools: PythonToolConfig,
    seed: int,
    variant: losses.Variant,
    policy: Policy,
    tokenizer: Any,
    state: dict[str, Any],
    prime: ImplicitPRM | None,
) -> Hooks:
    """The run's hooks. ``state``: the run state the sampling hooks start from (fresh, seeded or
    resumed); ``prime``: the implicit PRM (None: off), built before the checkpoint loads it."""
    advantages: list[AdvantageHook] = []
    if g.prm_credit == "step":
        advantages.append(step_credit_advantages)
    if prime is not None:
        advantages.append(ProcessAdvantages(prime, policy, g))
    masks: list[MaskHook] = [truncated_rows] if variant.use_truncation_mask else []
    if tools.drop_void_turns:
        masks.append(void_rows)
    return Hooks(
        InformativePrompts.build(data, seed, g.group_size, tokenizer, state),
        Replay.build(g.replay, state),
        tuple(advantages),
        tuple(masks),
    )
