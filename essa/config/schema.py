"""The top-level schema: :class:`Config` composes the sections, and :func:`check_values` runs
each section's own checks, then the checks that span sections (an algorithm, a backend and the
keys they need)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from essa.algorithms import RECIPES
from essa.config.backend import (
    VLLM_DROPPED_QUANTIZATION,
    AdapterConfig,
    GenerationConfig,
    ModelConfig,
    VLLMConfig,
    check_adapter,
    check_generation,
    check_model,
    check_vllm_ranges,
)
from essa.config.data import DataConfig, RewardConfig, check_data, check_reward
from essa.config.errors import ConfigError
from essa.config.es import (
    DriftBudgetConfig,
    OptimizerConfig,
    check_drift_budget,
    check_layerwise,
    check_optimizer,
)
from essa.config.evaluation import EvaluationConfig, check_evaluation
from essa.config.gradient import (
    DPOConfig,
    GRPOConfig,
    ScaleBiOConfig,
    SFTConfig,
    check_dpo,
    check_grpo,
    check_prm_credit,
    check_scalebio,
    check_sft,
)
from essa.config.run import RunConfig, check_run
from essa.config.tools import ToolsConfig, check_tools


@dataclass(frozen=True)
class Config:
    algorithm: str = "essa"  # a registered recipe (essa.algorithms): essa, grpo, dpo, scalebio
    backend: Literal["hf", "vllm"] = "hf"  # evaluation backend of the ESSA recipe
    model: ModelConfig = field(default_factory=ModelConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    run: RunConfig = field(default_factory=RunConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    scalebio: ScaleBiOConfig = field(default_factory=ScaleBiOConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)


def check_values(cfg: Config) -> None:
    """Range checks that types cannot express: each section's, then those across sections."""
    _check_algorithm(cfg.algorithm)
    check_optimizer(cfg.optimizer)
    check_adapter(cfg.adapter)
    check_data(cfg.data)
    check_generation(cfg.generation)
    check_evaluation(cfg.evaluation)
    check_sft(cfg.sft)
    check_run(cfg.run)
    check_model(cfg.model)
    check_reward(cfg.reward)
    check_grpo(cfg.grpo, cfg.generation.max_new_tokens)
    check_dpo(cfg.dpo)
    check_scalebio(cfg.scalebio)
    check_layerwise(cfg.optimizer.layerwise)
    check_drift_budget(cfg.optimizer.drift_budget)
    check_vllm_ranges(cfg.vllm)
    check_tools(cfg.tools)
    _check_reference_weight(cfg)
    _check_sft_adapter(cfg)
    if cfg.model.quantization != "none" and cfg.evaluation.strategy == "merged":
        raise ConfigError(
            f"evaluation.strategy: merged cannot fold candidates into "
            f"model.quantization={cfg.model.quantization} weights; use batched or auto"
        )
    gym_params = cfg.reward.params.get("params") or {}
    if cfg.reward.name == "gym_score" and gym_params != cfg.data.params:
        raise ConfigError(
            "reward.params.params: gym_score regenerates the task, so it needs the same "
            f"parameters as data.params; got {gym_params} vs {cfg.data.params}"
        )
    check_prm_credit(cfg.grpo, cfg.algorithm, cfg.reward.name)
    _check_dpo_takes_its_own(cfg)
    _check_scalebio(cfg)
    _check_vllm(cfg)
    _check_tool_rollouts(cfg)
    _check_drift_budget(cfg)
    _check_retention_task(cfg)


def _check_algorithm(name: str) -> None:
    """The choices are the recipe registry's names, so a registered recipe is a valid value."""
    if name not in RECIPES:
        known = " | ".join(repr(n) for n in RECIPES)
        raise ConfigError(f"algorithm: expected one of {known}, got {name!r}")


def _check_retention_task(cfg: Config) -> None:
    """Retention measures what a run may forget: a task it trains on cannot show that."""
    retention = cfg.evaluation.drift.retention
    tasks = (retention,) if isinstance(retention, str) else retention
    if tasks and all(task == cfg.data.source for task in tasks):  # a list: the first other one
        raise ConfigError(
            f"evaluation.drift.retention: {cfg.data.source} is the training task (data.source); "
            "retention is measured on a task the run does not train on"
        )


def _check_drift_budget(cfg: Config) -> None:
    """The drift budget steers ESSA's search (fitness terms, the mean's decay); its KL terms
    need the base model in process."""
    d = cfg.optimizer.drift_budget
    if d == DriftBudgetConfig():
        return
    if cfg.algorithm != "essa":
        what = (
            "decays ESSA's search mean toward its start"
            if d == DriftBudgetConfig(decay=d.decay)
            else "shapes ESSA's fitness"
        )
        raise ConfigError(
            f"optimizer.drift_budget: {what}; algorithm {cfg.algorithm} has its "
            "own regulariser (grpo.beta: the KL to the reference policy)"
        )
    if d.uses_kl and cfg.backend == "vllm":
        raise ConfigError(
            "optimizer.drift_budget: kl_penalty and kl_budget teacher-force the anchor set in "
            "the HF model; use backend: hf (anchor alone works with vllm)"
        )


def _check_tool_rollouts(cfg: Config) -> None:
    """Tool calls happen in the HF decode loop of ESSA populations and GRPO rollouts only."""
    t = cfg.tools.python
    if not t.max_tool_calls:
        if t.drop_void_turns:
            raise ConfigError(
                "tools.python.drop_void_turns: needs tool calls (set tools.python.max_tool_calls)"
            )
        return
    if cfg.algorithm not in ("essa", "grpo"):
        raise ConfigError(
            f"tools.python.max_tool_calls: tool calls run in essa and grpo rollouts; algorithm "
            f"{cfg.algorithm} generates no rollouts with tools (set it to 0)"
        )
    if cfg.backend != "hf":
        raise ConfigError(
            "tools.python.max_tool_calls: backend vllm cannot stop a row for a tool call and "
            "resume it; use backend: hf (or set it to 0)"
        )
    if t.drop_void_turns and cfg.algorithm != "grpo":
        raise ConfigError(
            "tools.python.drop_void_turns: SimpleTIR's filter drops trajectories from a policy "
            "gradient; algorithm essa has none (set it to false)"
        )
    if cfg.algorithm == "grpo" and cfg.grpo.replay.capacity:
        raise ConfigError(
            "grpo.replay.capacity: replayed completions are stored as the model's tokens only; "
            "with tools.python.max_tool_calls their tool outputs would be lost (set it to 0)"
        )
    if cfg.algorithm == "grpo" and cfg.grpo.prm_credit == "step":
        raise ConfigError(
            "grpo.prm_credit: step credit splits one text block into steps; it does not run "
            "with tools.python.max_tool_calls (use sequence)"
        )
    if cfg.algorithm == "grpo" and cfg.grpo.cure.use_branching:
        raise ConfigError(
            "grpo.cure.use_branching: CURE re-generates from a critical token of one text "
            "block; it does not run with tools.python.max_tool_calls (set one of them off)"
        )


def _check_reference_weight(cfg: Config) -> None:
    w = cfg.reward.reference_weight
    if cfg.reward.reference_signal != "likelihood" and not w:
        raise ConfigError(
            f"reward.reference_signal: {cfg.reward.reference_signal} is what the tie-breaker "
            "reads; it needs reward.reference_weight > 0"
        )
    if w and cfg.algorithm != "essa":
        raise ConfigError(
            "reward.reference_weight: the tie-breaker is part of the ESSA fitness; "
            f"algorithm {cfg.algorithm} takes the reward as it is (set it to 0)"
        )
    if w and cfg.backend != "hf":
        raise ConfigError(
            "reward.reference_weight: the reference is teacher-forced in the HF decode loop's "
            "prefill; backend: vllm does not return prompt log-probs per candidate (set it to 0)"
        )


def _check_dpo_takes_its_own(cfg: Config) -> None:
    """DPO reads dpo.*: a GRPO sampling setting under algorithm dpo would do nothing."""
    if cfg.algorithm != "dpo":
        return
    for key, value, own in (
        ("grpo.train_examples", cfg.grpo.train_examples, "dpo.train_examples"),
        ("grpo.entropy.floor", cfg.grpo.entropy.floor or None, "dpo.entropy_floor"),
    ):
        if value is not None:
            raise ConfigError(f"{key}: a GRPO setting; with algorithm dpo set {own}")


def _check_sft_adapter(cfg: Config) -> None:
    """ESSA searches the SFT adapter's singular values: refuse one that is zero by config."""
    if cfg.algorithm != "essa" or cfg.adapter.path is not None:
        return
    if cfg.sft.steps == 0 and cfg.optimizer.use_relative_steps:
        raise ConfigError(
            "sft.steps: must be > 0 without adapter.path: 0 leaves the new LoRA's B at zero "
            "(PEFT's initialisation) and ESSA's relative steps have no singular value to "
            "scale; train it, or set adapter.path to a trained LoRA"
        )


def _check_vllm(cfg: Config) -> None:
    v = cfg.vllm
    if cfg.backend != "vllm":
        return
    if cfg.algorithm != "essa":
        raise ConfigError(
            f"backend: vllm evaluates ESSA populations only; algorithm {cfg.algorithm} "
            "needs backend: hf"
        )
    if cfg.model.quantization != "none":
        raise ConfigError(
            f"model.quantization: {cfg.model.quantization} is bitsandbytes (HF backend only); "
            "vLLM dropped bitsandbytes: with backend: vllm use a pre-quantised AWQ/GPTQ/FP8 "
            "checkpoint and vllm.quantization"
        )
    if cfg.model.gguf_file:
        raise ConfigError("model.gguf_file: GGUF checkpoints need backend: hf")
    if v.quantization in VLLM_DROPPED_QUANTIZATION:
        raise ConfigError(
            f"vllm.quantization: {v.quantization} is gone from recent vLLM; INT4 on vLLM means "
            "a pre-quantised AWQ/GPTQ checkpoint (or fp8, compressed-tensors)"
        )


def _check_scalebio(cfg: Config) -> None:
    sources = cfg.data.sources
    if sources and cfg.algorithm != "scalebio":
        raise ConfigError(
            f"data.sources: a mixture of sources is trained by algorithm: scalebio, not "
            f"{cfg.algorithm} (use data.source)"
        )
    for name, path in sources.items():
        if not isinstance(path, str) or not path:
            raise ConfigError(f"data.sources.{name}: expected a file path or builtin:NAME")
    if cfg.algorithm != "scalebio":
        return
    if len(sources) < 2:
        raise ConfigError(
            f"data.sources: scalebio reweights two or more sources (name: path), got {len(sources)}"
        )
    if cfg.data.sft_size < 1:
        raise ConfigError(
            "data.sft_size: scalebio validates on the sft split of data.source; must be >= 1"
        )
    if cfg.adapter.path is not None:
        raise ConfigError(
            "adapter.path: scalebio fine-tunes the base weights with LISA and takes no LoRA "
            "adapter; merge it into the model first (essa export --merged) or drop adapter.path"
        )


TINY_SFT_STEPS = 20


def tiny_sft_warning(cfg: Config) -> str | None:
    """One line when a real (non-builtin) model starts from a tiny SFT of its own, else None.

    Tiny: fewer than :data:`TINY_SFT_STEPS` optimizer steps, or less than one pass over the
    SFT examples; the search can only rescale what SFT found (essa.md §1.2).
    """
    if cfg.model.name_or_path.startswith("builtin:") or cfg.adapter.path is not None:
        return None
    s = cfg.sft
    if s.steps >= TINY_SFT_STEPS and s.steps * s.batch_size >= cfg.data.sft_size:
        return None
    return (
        f"warning: sft.steps={s.steps} x sft.batch_size={s.batch_size} on "
        f"{cfg.data.sft_size} examples is a tiny SFT for {cfg.model.name_or_path}; ESSA only "
        "searches the singular values SFT found, so train a real SFT first (raise sft.steps, "
        "or set adapter.path to a trained LoRA)"
    )
