"""Held-out evaluation: section ``evaluation`` (with the final pass's drift report) and the
metrics that may score held-out data, with their range checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from essa.config.errors import ConfigError

# Rewards that compare a completion with the reference: the only held-out metrics (registered
# names; module:function rewards are taken at their word).
HELDOUT_METRICS = ("math_accuracy", "exact_match", "gym_score")


@dataclass(frozen=True)
class DriftConfig:
    """What else the final solution changed, beside the held-out score (docs/drift.md)."""

    prompts: int = 32  # off-task prompts for KL(base || tuned) and KL(SFT || tuned); 0: no KL
    tokens: int = 16  # the base model's greedy continuation of each, teacher-forced
    # Retention: greedy accuracy on a task the run does not train on, a built-in one
    # (builtin:NAME) or a reasoning-gym one at its default parameters (reasoning_gym:TASK);
    # auto: builtin:arithmetic_mixed, or builtin:arithmetic when that is the training task.
    # A list of tasks: the first that is not the training task (a real model's config names
    # tasks its base model can already do, in order: configs/smollm2.yaml).
    retention: str | tuple[str, ...] = "auto"
    items: int = 64  # held-out items for retention and for pass@K; 0: neither
    # Retention generates up to max(this, generation.max_new_tokens): a model that words its
    # answer (the base model in a chat template) must not be cut before it gets to it.
    retention_tokens: int = 32
    samples: int = 4  # K completions per held-out item for pass@K, maj@K, mean@K; < 2: none
    temperature: float = 1.0  # pass@K's sampling temperature
    # Off-task KL and the update size at every held-out pass too (metrics.jsonl, trackers); the
    # final pass always reports everything above.
    every_pass: bool = True


@dataclass(frozen=True)
class EvaluationConfig:
    strategy: Literal["auto", "batched", "merged"] = "auto"
    micro_batch_size: int = 1024  # sequences per forward
    every: int = 10  # held-out accuracy every N generations (0: only before and after)
    select: Literal["mean", "best"] = "mean"  # which solution is exported
    # Also report the SFT adapter uniformly scaled (no search): 8 extra populations on 256
    # prompts, so off by default.
    use_scale_baseline: bool = False
    use_prefix_cache: bool = True  # encode the prompts' shared token prefix once per candidate
    # Greedy, with the reference's likelihood in the fitness: read the reference tokens already
    # in the prefill as a draft, so rows skip the decode steps that would write them again
    # (essa.backends.decode); the tokens are greedy's, up to the matmuls' rounding order.
    reference_draft: bool = True
    # Held-out score: a correctness metric (HELDOUT_METRICS) or module:function comparing with
    # the reference answers. None: the training reward when it is one of these, else
    # math_accuracy (a shaping or label-free training reward says nothing about correctness).
    metric: str | None = None
    drift: DriftConfig = field(default_factory=DriftConfig)  # the final pass only


def check_evaluation(e: EvaluationConfig) -> None:
    if e.micro_batch_size <= 0:
        raise ConfigError(f"evaluation.micro_batch_size: must be > 0, got {e.micro_batch_size}")
    nonneg = {
        "evaluation.every": e.every,
        "evaluation.drift.prompts": e.drift.prompts,
        "evaluation.drift.items": e.drift.items,
        "evaluation.drift.samples": e.drift.samples,
    }
    for key, value in nonneg.items():
        if value < 0:
            raise ConfigError(f"{key}: must be >= 0, got {value}")
    _check_heldout_metric(e.metric)
    _check_drift(e.drift)


def _check_heldout_metric(metric: str | None) -> None:
    if metric is None or metric in HELDOUT_METRICS or ":" in metric:
        return
    raise ConfigError(
        f"evaluation.metric: {metric!r} does not compare completions with the reference answers, "
        f"so it cannot score held-out data; use one of {', '.join(HELDOUT_METRICS)} or "
        "module:function"
    )


def _check_drift(d: DriftConfig) -> None:
    from essa.sources import BUILTIN_SOURCES, GYM_PREFIX

    for key, value in (("tokens", d.tokens), ("retention_tokens", d.retention_tokens)):
        if value < 1:
            raise ConfigError(f"evaluation.drift.{key}: must be >= 1, got {value}")
    if not d.temperature > 0:
        raise ConfigError(f"evaluation.drift.temperature: must be > 0, got {d.temperature}")
    if d.retention in ("auto", "none"):
        return
    tasks = (d.retention,) if isinstance(d.retention, str) else d.retention
    if not tasks:
        raise ConfigError("evaluation.drift.retention: an empty list; none turns retention off")
    for task in tasks:
        if task.startswith(GYM_PREFIX):
            _check_gym_task(task.removeprefix(GYM_PREFIX))
        elif task not in BUILTIN_SOURCES:
            raise ConfigError(
                f"evaluation.drift.retention: {task!r} is not auto, none, "
                f"{GYM_PREFIX}TASK or one of {', '.join(BUILTIN_SOURCES)}"
            )


def _check_gym_task(task: str) -> None:
    """A reasoning-gym retention task exists (checked at load: retention runs after SFT)."""
    from essa.sources import gym_tasks

    where = f"evaluation.drift.retention: reasoning_gym:{task}"
    try:
        known = gym_tasks(f"{where} needs reasoning-gym (pip install 'essa-align[gym]')")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if task not in known:
        raise ConfigError(f"{where}: no such reasoning-gym task")
