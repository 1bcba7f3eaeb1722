"""The ES optimizer over an SVD adapter's search vector (whole or layerwise), and the
check that the adapter has something to search."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from essa.config import OptimizerConfig
from essa.errors import UserError
from essa.types import AdapterVector, Fitness, Population

if TYPE_CHECKING:
    from essa.adapters.svd import SVDAdapter
    from essa.protocols import Optimizer

log = logging.getLogger(__name__)


def make_es_optimizer(
    o: OptimizerConfig, seed: int, adapter: SVDAdapter, x0: AdapterVector | None = None
) -> Optimizer:
    """The configured optimizer over the adapter's D offsets, layerwise when configured;
    ``seed``: the run's (run.seed).

    ``x0`` (D,): the initial mean; None = zeros, the SFT adapter itself. With relative steps,
    coordinates that no step can move (``SVDAdapter.searchable``: zero singular values, modules
    whose update is zero) stay at ``x0`` and the optimizer searches the others
    (essa.optimizers.subspace). With ``optimizer.drift_budget.decay`` its mean moves back toward
    ``x0`` after every tell (essa.optimizers.decay).
    """
    from essa.optimizers import make_optimizer
    from essa.optimizers.decay import with_decay
    from essa.optimizers.subspace import Subspace

    options = o.options.kwargs()  # the optimizer's own constructor arguments
    stds = adapter.stds() if o.use_relative_steps else None
    free = None if stds is None else adapter.searchable()  # (D,) bool
    if free is not None and free.all():
        free = None  # nothing to hold: the plain optimizer and its own checkpoint format
    options.update(
        population_size=o.population_size,
        sigma0=o.sigma0,
        seed=seed,
        stds=stds if free is None or stds is None else stds[free],
    )
    if x0 is not None:  # only then: layerwise checkpoints written before x0 still load
        options["x0"] = x0 if free is None else np.asarray(x0)[free]
    dim = adapter.dim if free is None else int(free.sum())
    if o.layerwise.active_layers is None:
        opt = make_optimizer(o.name, dim, **options)
    else:
        opt = _layerwise_optimizer(o, adapter, dim, free, options)
    start = np.zeros(adapter.dim) if x0 is None else np.asarray(x0, dtype=np.float64)
    if free is not None:
        opt = Subspace(opt, free, start)
    return with_decay(opt, o.drift_budget.decay, start)  # optimizer.drift_budget.decay


def _layerwise_optimizer(
    o: OptimizerConfig,
    adapter: SVDAdapter,
    dim: int,
    free: np.ndarray | None,
    options: dict[str, Any],
) -> Optimizer:
    """LayerwiseES over the layers' searched coordinates (renumbered into ``free``'s)."""
    from essa.adapters.blocks import layer_blocks
    from essa.optimizers.layerwise import LayerwiseES

    try:
        blocks = layer_blocks(adapter.manifest())
    except ValueError as err:
        raise UserError(f"optimizer.layerwise: {err}") from None
    if free is not None:  # a layer without a searchable value drops out of the schedule
        index = np.cumsum(free) - 1  # (D,) position among the searched coordinates
        blocks = [b for b in ([int(index[i]) for i in block if free[i]] for block in blocks) if b]
    assert o.layerwise.active_layers is not None
    if o.layerwise.active_layers > len(blocks):
        raise UserError(
            f"optimizer.layerwise.active_layers: must be in 1..{len(blocks)} (the adapter's "
            f"layers), got {o.layerwise.active_layers}"
        )
    return LayerwiseES(
        dim,
        layer_indices=blocks,
        active_layers=o.layerwise.active_layers,
        interval=o.layerwise.interval,
        base=o.name,
        use_carried_sigma=o.layerwise.use_carried_sigma,
        **options,
    )


def check_searchable(
    o: OptimizerConfig, adapter: SVDAdapter, adapter_dir: str, *, given: bool
) -> None:
    """Refuse, in one line, an adapter (loaded from ``adapter_dir``; ``given``: by adapter.path,
    else trained by SFT) whose update gamma * B A no search step can move.

    With relative steps a zero singular value stays zero, and a zero factor keeps B'A' zero:
    an untrained LoRA (B at PEFT's zero init) has nothing to search. With absolute steps only
    gamma = 0 (lora_alpha 0) leaves nothing to search.
    """
    if o.use_relative_steps:
        if adapter.searchable().any():
            return
    elif any(module.gamma != 0 for module in adapter.modules):
        return
    where = f"adapter.path: {adapter_dir}" if given else f"sft: {adapter_dir}"
    raise UserError(
        f"{where} is an untrained LoRA (in every module B or A is zero, or lora_alpha is 0), "
        "so ESSA has no singular value to search; use a trained adapter (adapter.path) or "
        "train one first (sft.steps > 0, adapter.lora_alpha > 0)"
    )


def search_optimizer(
    cfg: OptimizerConfig, seed: int, adapter: SVDAdapter, scale: dict[str, Any] | None
) -> Optimizer:
    """The run's optimizer; with ``optimizer.start: scale_baseline`` its mean starts at the scale
    baseline's factor (``scale``, None when it did not run or failed: the SFT adapter)."""
    if cfg.start == "scale_baseline" and scale is not None:
        return make_es_optimizer(cfg, seed, adapter, x0=start_vector(cfg, adapter, scale))
    return make_es_optimizer(cfg, seed, adapter)


def start_vector(
    cfg: OptimizerConfig, adapter: SVDAdapter, scale: dict[str, Any] | None
) -> AdapterVector:
    """(D,) the offsets the search starts at: the scale baseline's factor, or zeros (the SFT
    adapter)."""
    from essa.es.start import scale_vector

    if cfg.start == "scale_baseline" and scale is not None:
        return scale_vector(adapter, scale["factor"])
    return np.zeros(adapter.dim)


def start_note(cfg: OptimizerConfig, state: dict[str, Any]) -> str:
    """The run's opening line's note on where the search starts (and, with
    ``drift_budget.decay``, that its mean decays back toward there); ``state``: the run's."""
    decay = cfg.drift_budget.decay
    pull = f"; the mean decays toward the start by {decay:g} a generation" if decay else ""
    return _start_place(cfg, state.get("scale_baseline"), state) + pull


def _start_place(cfg: OptimizerConfig, scale: dict[str, Any] | None, state: dict[str, Any]) -> str:
    if cfg.start != "scale_baseline":
        return ""
    if state.get("scaled_start_skipped"):  # essa.es.baselines: the SFT adapter at an edge
        return "; the scaled start was not tried (the SFT adapter is at an edge on validation)"
    if scale is None:
        return "; the scale baseline failed, so the search starts at the SFT adapter"
    if scale.get("validated") is False:  # essa.es.watch: no better than SFT on validation
        return (
            f"; the scaled start x{scale['factor']:g} did not beat the SFT adapter on "
            "validation, so the search starts at the SFT adapter"
        )
    return f"; the search starts at the SFT adapter x{scale['factor']:g} (the scale baseline)"


def tell(
    cfg: OptimizerConfig,
    opt: Optimizer,
    population: Population,
    fitness: Fitness,
    pool: dict[str, Any],
) -> dict[str, float]:
    """opt.tell with the optimizer's own arguments for this generation
    (``EsOptions.tell_kwargs``: e.g. a step size widened after a generation whose task reward,
    before the tie-breaker, ranked nothing)."""
    extra = cfg.options.tell_kwargs(reward_flat=bool(pool.get("reward_flat")))
    return opt.tell(population, fitness, **extra)
