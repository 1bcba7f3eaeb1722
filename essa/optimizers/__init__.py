"""Gradient-free optimizers over the adapter search vector: numpy (and lazily pycma) only.

Fitness is higher-is-better with NaN = failed evaluation. Every optimizer satisfies the
``Optimizer`` Protocol (ask/tell, plain-data state, checksum); pick one by name:

>>> opt = make_optimizer("openai_es", 3, population_size=4, sigma0=0.1, seed=0)
>>> opt.ask().shape
(4, 3)

An ES optimizer is one module: its class, its options dataclass (its config keys, their checks,
its pairing rule; :class:`EsOptions`), its seed domains, and an :class:`EsOptimizerSpec` that
one :func:`register` line below adds. The config, the ES loop, the budget plan and the seeding
ask the registry (:func:`optimizer_spec`) and never name an optimizer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import essa.seeding as seeding
from essa.optimizers import cma_es, openai_es, snes
from essa.optimizers.base import EsOptimizerSpec, EsOptions, Optimizer, OptimizerFactory
from essa.optimizers.shaping import centered_ranks, fill_failed, ranks_nan_worst, z_score

OPTIMIZERS: dict[str, EsOptimizerSpec] = {}


def register(spec: EsOptimizerSpec) -> EsOptimizerSpec:
    """Add ``spec`` to the registry and its seed domains to essa.seeding's; returns it.

    Registering the same entry again is a no-op; another entry under a taken name is refused.
    """
    options = spec.options
    # A dataclass subclassing the frozen EsOptions is frozen itself (dataclasses refuse otherwise).
    own = isinstance(options, type) and "__dataclass_fields__" in vars(options)
    if not (own and issubclass(options, EsOptions)):
        raise TypeError(f"{spec.name}: options must be a dataclass subclassing EsOptions")
    options()  # every key needs a default: a config that leaves it out takes it
    known = OPTIMIZERS.get(spec.name)
    if known is not None and known != spec:
        raise ValueError(f"optimizer {spec.name!r} is already registered")
    seeding.register_domains(spec.seed_domains)
    OPTIMIZERS[spec.name] = spec
    return spec


# One line per ES optimizer (its module imported above):
register(cma_es.SPEC)
register(openai_es.SPEC)
register(snes.SPEC)
DEFAULT_OPTIMIZER = cma_es.SPEC.name  # ESSA's own (v3 §3.2)


def optimizer_spec(name: str) -> EsOptimizerSpec:
    """The registry entry of ``name``; ValueError listing the known names otherwise."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(sorted(OPTIMIZERS))}")
    return OPTIMIZERS[name]


def make_optimizer(
    name: str,
    dim: int,
    *,
    population_size: int,
    sigma0: float,
    seed: int,
    stds: np.ndarray | None = None,
    **options: Any,
) -> Optimizer:
    """Build the registered optimizer ``name``; ``options`` are its own keyword arguments."""
    return optimizer_spec(name).factory(
        dim, population_size=population_size, sigma0=sigma0, seed=seed, stds=stds, **options
    )


__all__ = [
    "DEFAULT_OPTIMIZER",
    "OPTIMIZERS",
    "EsOptimizerSpec",
    "EsOptions",
    "Optimizer",
    "OptimizerFactory",
    "centered_ranks",
    "fill_failed",
    "make_optimizer",
    "optimizer_spec",
    "ranks_nan_worst",
    "register",
    "z_score",
]
