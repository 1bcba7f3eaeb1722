"""LISA-style layer sampling, shared by gradient LISA and layerwise ES; numpy only.

``active_layers(seed, interval_index, num_layers, gamma)`` is the schedule: which gamma layers
are active during interval ``interval_index``. It is a pure function of its arguments (its own
``SeedSequence``, never the global RNG), so every MPI rank and every resumed run agrees.

``LayerwiseES`` wraps any registered optimizer (CMA-ES, OpenAI-ES, SNES) and searches, for
``interval`` generations at a time, only the coordinates of the sampled layers' blocks; the
other coordinates keep their current values (what earlier blocks learned). At each switch a fresh
inner optimizer starts with its mean at the current values of the new block.

Deviations from LISA (Pan et al., arXiv 2403.17919, Alg. 1) and project choices:
* LISA samples layers for AdamW; here the same schedule picks which singular values ES searches
  (a project extension: no literature numbers exist for it).
* Layers are sampled uniformly without replacement by default, as in LMFlow; ``weights`` make
  the draw weighted (numpy's ``choice(p=...)``) without replacement.
* Step size at a switch: the fresh inner optimizer restarts at ``sigma0`` by default (a new
  block's coordinates have not been searched yet, so an adapted sigma from other layers says
  little about them); ``use_carried_sigma=True`` starts it at the last block's final sigma
  instead. The covariance (CMA-ES) or moments (OpenAI-ES) always restart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import essa.seeding as seeding
from essa.optimizers import make_optimizer
from essa.optimizers.base import (
    BestSoFar,
    as_vector,
    canonical_json,
    check_same_config,
    check_state_header,
    sha256_hex,
)
from essa.types import AdapterVector, Fitness, Population

STATE_FORMAT = 1


def active_layers(
    seed: int,
    interval_index: int,
    num_layers: int,
    gamma: int,
    weights: Sequence[float] | None = None,
) -> tuple[int, ...]:
    """The gamma layers (sorted) active in interval ``interval_index``; pure and seeded.

    >>> active_layers(0, 0, 4, 2) == active_layers(0, 0, 4, 2)
    True
    >>> len(active_layers(0, 7, 24, 4))
    4
    """
    if num_layers < 1 or not 1 <= gamma <= num_layers:
        raise ValueError(f"gamma must be in 1..{num_layers}, got {gamma}")
    if seed < 0 or interval_index < 0:
        raise ValueError("seed and interval_index must be >= 0")
    p = None
    if weights is not None:
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (num_layers,) or not np.all(np.isfinite(w)) or np.any(w < 0):
            raise ValueError(f"weights must be {num_layers} finite values >= 0")
        if np.count_nonzero(w) < gamma:
            raise ValueError(f"weights must give at least {gamma} layers a positive weight")
        p = w / w.sum()
    rng = seeding.rng(seed, "layerwise.schedule", interval_index)
    chosen = rng.choice(num_layers, size=gamma, replace=False, p=p)
    return tuple(sorted(int(i) for i in chosen))


def block_seed(seed: int, block: int) -> int:
    """Seed of block ``block``'s inner optimizer: distinct per block, pure in (seed, block)."""
    return seeding.seed_int(seed, "layerwise.block_seed", block)


class LayerwiseES(BestSoFar):
    """An ES over a (D,) vector that searches gamma sampled layers' coordinates per interval.

    ``layer_indices[l]`` lists the coordinates of layer l (from the adapter's layout manifest).
    Satisfies the ``Optimizer`` Protocol, so the ES loop and its resume and replica checks run
    unchanged: ``ask`` returns full (P, D) candidates whose inactive coordinates equal the
    current mean.
    """

    name = "layerwise"

    def __init__(
        self,
        dim: int,
        *,
        layer_indices: Sequence[Sequence[int]],  # per layer: its coordinates in the vector
        active_layers: int,  # gamma: layers searched per interval
        interval: int,  # generations per interval (block)
        base: str,  # the inner optimizer's registered name
        population_size: int,
        sigma0: float,
        seed: int,
        stds: np.ndarray | None = None,  # (D,) relative steps; sliced per block
        use_carried_sigma: bool = False,  # start each block at the last block's sigma
        x0: np.ndarray | None = None,  # (D,) initial anchor; zeros = the SFT adapter in ESSA
        **options: Any,  # the inner optimizer's own options
    ) -> None:
        self._layers = [
            np.asarray(sorted(int(i) for i in ix), dtype=np.int64) for ix in layer_indices
        ]
        covered = np.concatenate(self._layers) if self._layers else np.empty(0, np.int64)
        if covered.size != dim or not np.array_equal(np.sort(covered), np.arange(dim)):
            raise ValueError("layer_indices must partition range(dim)")
        if not 1 <= active_layers <= len(self._layers):
            raise ValueError(
                f"active_layers must be in 1..{len(self._layers)}, got {active_layers}"
            )
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self._dim = dim
        self._stds = None if stds is None else as_vector(stds, dim, "stds", positive=True)
        self._base = base
        self._options = dict(options)
        self._config: dict[str, Any] = {
            "dim": dim,
            "layers": [ix.tolist() for ix in self._layers],
            "active_layers": active_layers,
            "interval": interval,
            "base": base,
            "population_size": population_size,
            "sigma0": float(sigma0),
            "seed": seed,
            "stds": None if self._stds is None else self._stds.tolist(),
            "use_carried_sigma": use_carried_sigma,
            "options": {k: options[k] for k in sorted(options)},
        }
        anchor0 = np.zeros(dim) if x0 is None else as_vector(x0, dim, "x0")
        if x0 is not None:  # only then, so that checkpoints written before the option still load
            self._config["x0"] = anchor0.tolist()
        self._start_block(0, anchor0, float(sigma0))
        self._generation = 0

    # ------------------------------------------------------------------ blocks
    def _start_block(self, block: int, anchor: AdapterVector, sigma: float) -> None:
        """Fresh inner optimizer over the block's coordinates, its mean at ``anchor`` there."""
        c = self._config
        self._block = block
        self._block_layers = active_layers(c["seed"], block, len(self._layers), c["active_layers"])
        self._index = np.sort(np.concatenate([self._layers[i] for i in self._block_layers]))
        self._anchor = anchor.copy()  # (D,) full vector at the block start
        self._block_sigma0 = sigma
        self._inner = make_optimizer(
            self._base,
            int(self._index.size),
            population_size=c["population_size"],
            sigma0=sigma,
            seed=block_seed(c["seed"], block),
            stds=None if self._stds is None else self._stds[self._index],
            x0=anchor[self._index],
            **self._options,
        )

    @property
    def active(self) -> tuple[int, ...]:
        """Layers searched in the current block."""
        return self._block_layers

    @property
    def active_index(self) -> np.ndarray:
        """(d,) coordinates searched in the current block."""
        return self._index.copy()

    # ------------------------------------------------------------------ Optimizer Protocol
    @property
    def dim(self) -> int:
        return self._dim

    @property
    def population_size(self) -> int:
        return int(self._config["population_size"])

    @property
    def mean(self) -> AdapterVector:
        full = self._anchor.copy()
        full[self._index] = self._inner.mean
        return full

    @property
    def sigma(self) -> float:
        return self._inner.sigma

    @property
    def generation(self) -> int:
        return self._generation

    def ask(self) -> Population:
        """(P, D): the inner population on the active coordinates, the anchor elsewhere."""
        sub = self._inner.ask()  # (P, d)
        population = np.tile(self._anchor, (sub.shape[0], 1))  # (P, D)
        population[:, self._index] = sub
        return population

    def tell(self, population: Population, fitness: Fitness) -> dict[str, float]:
        population = np.asarray(population, dtype=np.float64)
        inactive = np.ones(self._dim, dtype=bool)
        inactive[self._index] = False
        if not np.array_equal(
            population[:, inactive], np.tile(self._anchor[inactive], (len(population), 1))
        ):
            raise ValueError("tell() must receive the exact population returned by the last ask()")
        metrics = self._inner.tell(population[:, self._index], fitness)
        self._update_best(population, np.asarray(fitness, dtype=np.float64))
        self._generation += 1
        metrics.update(block=float(self._block), generation=float(self._generation))
        if self._generation % self._config["interval"] == 0:
            carried = (
                self._inner.sigma if self._config["use_carried_sigma"] else self._config["sigma0"]
            )
            self._start_block(self._generation // self._config["interval"], self.mean, carried)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """Config + the current block's anchor, start sigma and inner state (plain JSON)."""
        return {
            "optimizer": self.name,
            "format": STATE_FORMAT,
            "config": dict(self._config),
            "generation": self._generation,
            "block": self._block,
            "anchor": self._anchor.tolist(),
            "block_sigma0": self._block_sigma0,
            "inner": self._inner.state_dict(),
            **self._best_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Rebuild the current block's inner optimizer and replay its own state into it."""
        check_state_header(state, self.name, STATE_FORMAT)
        check_same_config(state["config"], self._config, self.name)
        anchor = as_vector(state["anchor"], self._dim, "anchor")
        self._start_block(int(state["block"]), anchor, float(state["block_sigma0"]))
        self._inner.load_state_dict(state["inner"])
        self._generation = int(state["generation"])
        self._load_best(state)

    def checksum(self) -> str:
        """sha256 over this wrapper's state and the inner optimizer's own checksum."""
        state = self.state_dict()
        state.pop("inner")
        return sha256_hex(canonical_json(state).encode(), self._inner.checksum().encode())
