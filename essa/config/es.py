"""The ES search: section ``optimizer`` (CMA-ES or OpenAI-ES over the singular values, and
layerwise ES) with its range checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from essa.config.errors import ConfigError


@dataclass(frozen=True)
class LayerwiseConfig:
    """Layerwise ES: search only the singular values of sampled layers, block by block."""

    active_layers: int | None = None  # layers searched per block; None searches all (plain ESSA)
    interval: int = 20  # generations per block
    use_carried_sigma: bool = False  # a new block starts at sigma0 (False) or the last sigma


@dataclass(frozen=True)
class DriftBudgetConfig:
    """What the search may change off-task (docs/drift.md, "A drift budget in the search")."""

    # fitness -= kl_penalty * KL(base || candidate), mean per token on the anchor set
    kl_penalty: float = 0.0
    # A candidate whose anchor-set KL(base || candidate) exceeds it ranks below every candidate
    # within it (those over it by their KL); None: no constraint.
    kl_budget: float | None = None
    prompts: int = 8  # the anchor set: the first off-task prompts of essa.drift.offtask_prompts
    tokens: int = 16  # the base model's greedy continuation of each, teacher-forced
    # fitness -= anchor * mean_i ((x_i - x_SFT,i) / s_i)^2: weight decay toward the SFT adapter
    # in the searched coordinates (s_i: the SFT singular value), the ES form of an anchor.
    anchor: float = 0.0

    @property
    def uses_kl(self) -> bool:
        return bool(self.kl_penalty) or self.kl_budget is not None


@dataclass(frozen=True)
class OptimizerConfig:
    name: Literal["cma_es", "openai_es"] = "cma_es"
    population_size: int = 16  # lambda; the paper's default is 96
    # Initial step, in units of each SFT singular value when use_relative_steps: 0.1 (spec §4)
    # keeps a real model's answers intact.
    sigma0: float = 0.1
    use_relative_steps: bool = True  # scale each coordinate by its SFT singular value
    variant: Literal["auto", "full", "sep"] = "auto"  # cma_es covariance
    sep_above_dim: int = 2000  # cma_es: diagonal covariance above this dimension when auto
    mirrored: bool = False  # cma_es: antithetic candidate pairs (openai_es always samples them)
    # cma_es: when the task reward ties the top 70% of the population (the reference tie-breaker
    # alone ranks them), multiply sigma by exp(0.2 + cs/damps), about 1.22: Hansen's escape from
    # flat fitness, so candidates that all answer alike are pushed apart until the reward ranks.
    escape_flat_reward: bool = False
    # Where the search starts: the SFT adapter (offsets 0), or the no-search baseline's best
    # uniformly scaled SFT adapter (runs the scale baseline; its factor chosen on training
    # prompts), so the search spends no generations on the one direction scaling already finds.
    start: Literal["sft", "scale_baseline"] = "sft"
    lr: float = 0.1  # openai_es step size
    step: Literal["adam", "sgd"] = "adam"  # openai_es step rule
    layerwise: LayerwiseConfig = field(default_factory=LayerwiseConfig)
    drift_budget: DriftBudgetConfig = field(default_factory=DriftBudgetConfig)


def check_optimizer(o: OptimizerConfig) -> None:
    for key, value in (("optimizer.sigma0", o.sigma0), ("optimizer.lr", o.lr)):
        if value <= 0:
            raise ConfigError(f"{key}: must be > 0, got {value}")
    if o.sep_above_dim < 0:
        raise ConfigError(f"optimizer.sep_above_dim: must be >= 0, got {o.sep_above_dim}")
    if o.population_size < 2:
        raise ConfigError(
            f"optimizer.population_size: must be >= 2 (ES ranks candidates), got "
            f"{o.population_size}"
        )
    if o.mirrored and o.name != "cma_es":
        raise ConfigError("optimizer.mirrored: applies to cma_es (openai_es is always antithetic)")
    if o.escape_flat_reward and (o.name != "cma_es" or o.layerwise.active_layers is not None):
        raise ConfigError(
            "optimizer.escape_flat_reward: applies to cma_es without layerwise (it widens "
            "CMA-ES's step size)"
        )
    if o.mirrored and o.population_size % 2:
        raise ConfigError("optimizer.population_size: mirrored pairs need an even population")
    if o.name == "openai_es" and o.population_size % 2:
        raise ConfigError(
            "optimizer.population_size: openai_es needs an even population (antithetic pairs)"
        )


def check_layerwise(w: LayerwiseConfig) -> None:
    """Counts >= 1 here; active_layers <= the model's layers is checked at run time."""
    checks = {"optimizer.layerwise.interval": w.interval}
    if w.active_layers is not None:
        checks["optimizer.layerwise.active_layers"] = w.active_layers
    for key, value in checks.items():
        if value < 1:
            raise ConfigError(f"{key}: must be >= 1, got {value}")


def check_drift_budget(d: DriftBudgetConfig) -> None:
    for key, value in (("kl_penalty", d.kl_penalty), ("anchor", d.anchor)):
        if value < 0:
            raise ConfigError(f"optimizer.drift_budget.{key}: must be >= 0, got {value}")
    if d.kl_budget is not None and not d.kl_budget > 0:
        raise ConfigError(f"optimizer.drift_budget.kl_budget: must be > 0, got {d.kl_budget}")
    for key, value in (("prompts", d.prompts), ("tokens", d.tokens)):
        if value < 1:
            raise ConfigError(f"optimizer.drift_budget.{key}: must be >= 1, got {value}")
