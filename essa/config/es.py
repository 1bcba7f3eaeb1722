"""The ES search: section ``optimizer`` (an ES optimizer of essa.optimizers' registry over the
singular values, and layerwise ES) with its range checks.

The keys every optimizer shares are :class:`OptimizerConfig`'s fields; the chosen optimizer's
own keys (its :class:`~essa.optimizers.EsOptions` dataclass) sit flat in the same section and
are read against that dataclass (:func:`flat_options`), so a new optimizer brings its keys
without a line in this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from essa.config.errors import ConfigError
from essa.optimizers import DEFAULT_OPTIMIZER, OPTIMIZERS, EsOptions, optimizer_spec


def _names() -> str:
    return " | ".join(repr(name) for name in sorted(OPTIMIZERS))


def flat_options(section: Mapping[str, Any]) -> tuple[type[EsOptions], set[str]]:
    """For the loader, from the raw ``optimizer`` section: the chosen optimizer's options
    dataclass, whose keys the section holds flat, and the keys of other optimizers it accepts and
    ignores: those at their defaults, so a config that lists every optimizer's keys still loads.
    A key of another optimizer set to anything else is refused, naming its optimizer."""
    name = section.get("name", DEFAULT_OPTIMIZER)
    if not isinstance(name, str) or name not in OPTIMIZERS:
        raise ConfigError(f"optimizer.name: expected one of {_names()}, got {name!r}")
    own = [f.name for f in fields(OPTIMIZERS[name].options)]
    ignored = set()
    for key, value in section.items():
        owners = [s for s in OPTIMIZERS.values() if key in _keys(s.options)]
        if key in own or not owners:
            continue
        if any(value == getattr(s.options(), key) for s in owners):
            ignored.add(key)
            continue
        raise ConfigError(
            f"optimizer.{key}: applies to {' and '.join(s.name for s in owners)}, not {name} "
            f"({name}'s own keys: {', '.join(own) or 'none'})"
        )
    return OPTIMIZERS[name].options, ignored


def _keys(options: type[EsOptions]) -> set[str]:
    return {f.name for f in fields(options)}


def _default_options() -> EsOptions:
    return optimizer_spec(DEFAULT_OPTIMIZER).options()


@dataclass(frozen=True)
class LayerwiseConfig:
    """Layerwise ES: search only the singular values of sampled layers, block by block."""

    active_layers: int | None = None  # layers searched per block; None searches all (plain ESSA)
    interval: int = 20  # generations per block
    use_carried_sigma: bool = False  # a new block starts at sigma0 (False) or the last sigma


@dataclass(frozen=True)
class DriftBudgetConfig:
    """What the search may change off-task (docs/drift-control.md)."""

    # fitness -= kl_penalty * KL(base || candidate), mean per token on the anchor set
    kl_penalty: float = 0.0
    # A candidate whose anchor-set KL(base || candidate) exceeds it ranks below every candidate
    # within it (those over it by their KL), and the exported adapter's off-task KL in the
    # drift report is held within it (essa.es.kl_promise); None: no constraint.
    kl_budget: float | None = None
    # The same budget as a multiple of the SFT adapter's own KL(base || SFT), which the run
    # measures on each set (the anchor set, the report's): 1.25 lets the search drift a quarter
    # further off-task than SFT did, on any task; exclusive with kl_budget.
    kl_budget_sft: float | None = None
    prompts: int = 8  # the anchor set: the first of essa.drift.offtask.offtask_prompts
    tokens: int = 16  # the base model's greedy continuation of each, teacher-forced
    # fitness -= anchor * mean_i ((x_i - x_SFT,i) / s_i)^2: weight decay toward the SFT adapter
    # in the searched coordinates (s_i: the SFT singular value), the ES form of an anchor.
    anchor: float = 0.0
    # After every tell the search mean moves back toward its start x0 (the SFT adapter or the
    # scaled start): m <- x0 + (1 - decay) (m - x0), decoupled weight decay for any optimizer.
    decay: float = 0.0

    @property
    def uses_kl(self) -> bool:
        return bool(self.kl_penalty) or self.has_budget

    @property
    def has_budget(self) -> bool:
        return self.kl_budget is not None or self.kl_budget_sft is not None


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = DEFAULT_OPTIMIZER  # a registered ES optimizer (essa.optimizers.OPTIMIZERS)
    population_size: int = 16  # lambda; the paper's default is 96
    # Initial step, in units of each SFT singular value when use_relative_steps: 0.1 (spec §4)
    # keeps a real model's answers intact.
    sigma0: float = 0.1
    use_relative_steps: bool = True  # scale each coordinate by its SFT singular value
    # The optimizer's own keys, written flat in the section (its EsOptions dataclass, in its
    # module of essa.optimizers); keys left out take its defaults.
    options: EsOptions = field(default_factory=_default_options, metadata={"flat": flat_options})
    # Where the search starts: the SFT adapter (offsets 0), or the no-search baseline's best
    # uniformly scaled SFT adapter (runs the scale baseline; its factor chosen on training
    # prompts), so the search spends no generations on the one direction scaling already finds.
    start: Literal["sft", "scale_baseline"] = "sft"
    layerwise: LayerwiseConfig = field(default_factory=LayerwiseConfig)
    drift_budget: DriftBudgetConfig = field(default_factory=DriftBudgetConfig)

    def __post_init__(self) -> None:
        # Options left at another optimizer's defaults (the field's default, or a replace() of
        # the name) stand for "none given": the named optimizer's defaults.
        spec = OPTIMIZERS.get(self.name) if isinstance(self.name, str) else None
        given = self.options
        if spec is not None and not isinstance(given, spec.options) and given == type(given)():
            object.__setattr__(self, "options", spec.options())


def check_optimizer(o: OptimizerConfig) -> None:
    if o.name not in OPTIMIZERS:
        raise ConfigError(f"optimizer.name: expected one of {_names()}, got {o.name!r}")
    if o.sigma0 <= 0:
        raise ConfigError(f"optimizer.sigma0: must be > 0, got {o.sigma0}")
    if o.population_size < 2:
        raise ConfigError(
            f"optimizer.population_size: must be >= 2 (ES ranks candidates), got "
            f"{o.population_size}"
        )
    own = OPTIMIZERS[o.name].options
    if not isinstance(o.options, own):
        raise ConfigError(
            f"optimizer.name: {o.name} takes {own.__name__}, got {type(o.options).__name__}"
        )
    try:
        o.options.check(o.population_size, layerwise=o.layerwise.active_layers is not None)
    except ValueError as err:  # "KEY: why", KEY in this section
        raise ConfigError(f"optimizer.{err}") from None


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
    if not 0 <= d.decay < 1:
        raise ConfigError(f"optimizer.drift_budget.decay: must be in [0, 1), got {d.decay}")
    for key, budget in (("kl_budget", d.kl_budget), ("kl_budget_sft", d.kl_budget_sft)):
        if budget is not None and not budget > 0:
            raise ConfigError(f"optimizer.drift_budget.{key}: must be > 0, got {budget}")
    if d.kl_budget is not None and d.kl_budget_sft is not None:
        raise ConfigError(
            "optimizer.drift_budget: kl_budget and kl_budget_sft both set; keep one (an "
            "absolute budget, or one in units of the SFT adapter's own KL)"
        )
    for key, value in (("prompts", d.prompts), ("tokens", d.tokens)):
        if value < 1:
            raise ConfigError(f"optimizer.drift_budget.{key}: must be >= 1, got {value}")
