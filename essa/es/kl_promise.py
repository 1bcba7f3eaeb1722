"""The KL budget as a promise on the exported adapter (``optimizer.drift_budget.kl_budget``, or
``kl_budget_sft``: B = that multiple of the SFT adapter's own KL(base || SFT) on the same set).

During the search the budget ranks candidates on a small anchor set (essa.es.drift_budget).
What the user reads is the drift report's off-task KL(base || tuned) of the *exported* adapter,
on ``evaluation.drift``'s off-task set (its ``prompts`` prompts, the base model's greedy
continuations of ``tokens`` tokens). The promise: that figure is at most B. It is held where it
is cheap, at the export, along one path of points (offsets of the singular values):

    P(u) = (u - 1) s + u x0          for u in [0, 1]: the base model (every searched singular
                                     value at zero) to the search's start x0, values scaled by u
    P(u) = x0 + (u - 1)(x - x0)      for u in [1, 2]: the start to the chosen point x

KL is 0 at u = 0 and grows along the path (not necessarily monotonically), so the largest
u whose KL is within B is found on a grid of :data:`GRID` points in one population-batched
forward (rows carry the points), then on :data:`GRID` points between that one and the next. The
held point's validation score says what holding cost: if it no longer beats the SFT adapter by
more than its paired SE, the SFT adapter (held along its own path when it is itself over B) is
exported instead, as an unvalidated search point would be (essa.es.watch).

The KL here and the report's come from the same prompts and the same cached base continuations
(essa.drift.offtask.ContinuationCache), so the report's figure is the one the promise held.
Every rank computes the same KL and takes rank 0's, so every rank exports the same point.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from essa.types import AdapterVector, Population

if TYPE_CHECKING:
    from essa.adapters.svd import SVDAdapter
    from essa.dist import Comm
    from essa.drift.offtask import ContinuationCache
    from essa.drift.report import DriftSettings
    from essa.es.drift_budget import AnchorSet

GRID = 8  # points per batched KL pass along the path
# The path is searched for KL within (1 - MARGIN) B: the report measures the same pairs in
# another forward (other batch shapes, float32 rounding), and its figure is the promised one.
MARGIN = 0.01


def path_points(
    u: np.ndarray, scale: np.ndarray, x0: AdapterVector, x: AdapterVector
) -> Population:
    """(K, D) offsets at path positions ``u`` (K,) in [0, 2]: base model -> x0 -> x.

    >>> p = path_points(np.array([0.0, 0.5, 1.0, 1.5, 2.0]), np.array([2.0]), np.array([1.0]),
    ...                 np.array([3.0]))
    >>> p[:, 0].tolist()  # singular value s + offset: 0, 1.5, 3 (x0), 4, 5 (x)
    [-2.0, -0.5, 1.0, 2.0, 3.0]
    """
    u = np.asarray(u, dtype=np.float64)[:, None]  # (K, 1)
    x0, x, s = (np.asarray(v, dtype=np.float64)[None, :] for v in (x0, x, scale))  # (1, D)
    to_start = (u - 1.0) * s + u * x0  # values u (s + x0)
    to_point = x0 + (u - 1.0) * (x - x0)
    return np.where(u <= 1.0, to_start, to_point)


def largest_within(u: np.ndarray, kl: np.ndarray, budget: float) -> int | None:
    """Index of the largest ``u`` whose ``kl`` is within ``budget`` (None: none is).

    >>> largest_within(np.array([0.0, 1.0, 2.0]), np.array([0.0, 0.3, 0.2]), 0.25)
    2
    >>> largest_within(np.array([0.0, 1.0]), np.array([0.5, 0.6]), 0.25) is None
    True
    """
    within = np.flatnonzero(np.asarray(kl) <= budget)
    return None if within.size == 0 else int(within[np.argmax(np.asarray(u)[within])])


@dataclass
class Held:
    """A point held to the budget: where on the path, and its KL before and after."""

    vector: AdapterVector  # (D,)
    u: float  # its path position: 2 is the point itself, 1 the start, 0 the base model
    kl_before: float  # KL(base || point) of the point as chosen
    kl: float  # KL(base || held point)

    @property
    def moved(self) -> bool:
        return self.u < 2.0


@dataclass
class KLPromise:
    """``kl_budget`` on the report's off-task set for one run's adapter."""

    budget: float | None  # B; None: ratio x the SFT adapter's KL, measured at the first hold
    kl_of: Callable[[Population], np.ndarray]  # (K, D) -> (K,) KL(base || point)
    scale: np.ndarray  # (D,) SFT singular values at the searched positions
    comm: Comm | None = None
    evaluated: list[tuple[float, float]] = field(default_factory=list)  # (u, KL) seen
    ratio: float | None = None  # kl_budget_sft: B in units of KL(base || SFT) on this set

    def limit(self) -> float:
        """B: the budget given, or ``ratio`` x the SFT adapter's own KL(base || SFT) on the
        report's set (measured once, here)."""
        if self.budget is None:
            assert self.ratio is not None
            sft = float(self.kl(np.zeros((1, len(self.scale))))[0])
            self.budget = self.ratio * sft
        return self.budget

    def kl(self, points: Population) -> np.ndarray:
        """(K,) KL of ``points``, rank 0's on every rank."""
        kl = np.asarray(self.kl_of(np.atleast_2d(points)), dtype=np.float64)
        if self.comm is not None and self.comm.world_size > 1:
            kl = self.comm.allgather_fitness(kl)[: len(kl)]  # rank 0's shard first
        return kl

    def hold(self, x: AdapterVector, x0: AdapterVector) -> Held:
        """``x`` moved along base -> ``x0`` -> ``x`` to the furthest point within the budget."""
        x, x0 = np.asarray(x, dtype=np.float64), np.asarray(x0, dtype=np.float64)
        before = float(self.kl(x[None, :])[0])
        self.evaluated.append((2.0, before))
        target = self.limit() * (1.0 - MARGIN)
        if before <= target:
            return Held(x, 2.0, before, before)
        u = np.linspace(0.0, 2.0, GRID + 1)[:-1]  # (GRID,) 0 .. 1.75; 2 is over
        kl = self.kl(path_points(u, self.scale, x0, x))
        self.evaluated.extend(zip(u.tolist(), kl.tolist(), strict=True))
        i = largest_within(u, kl, target)
        if i is None:  # even the base end is over: k < r leaves singular values unsearched
            low = int(np.argmin(kl))
            return Held(path_points(u[low : low + 1], self.scale, x0, x)[0], float(u[low]),
                        before, float(kl[low]))  # fmt: skip
        fine = u[i] + (2.0 / GRID) * np.arange(1, GRID + 1) / (GRID + 1)  # between u_i and u_i+1
        fine_kl = self.kl(path_points(fine, self.scale, x0, x))
        self.evaluated.extend(zip(fine.tolist(), fine_kl.tolist(), strict=True))
        both_u, both_kl = np.append(u[i], fine), np.append(kl[i], fine_kl)
        j = largest_within(both_u, both_kl, target)
        assert j is not None  # u[i] itself is within
        point = path_points(both_u[j : j + 1], self.scale, x0, x)[0]
        return Held(point, float(both_u[j]), before, float(both_kl[j]))


def kl_promise(
    budget: float | None,
    s: DriftSettings,
    cache: ContinuationCache,
    model: Any,
    tokenizer: Any,
    adapter: SVDAdapter,
    comm: Comm | None = None,
    ratio: float | None = None,
) -> KLPromise | None:
    """The run's promise (None: no ``kl_budget`` nor ``kl_budget_sft`` (``ratio``), no base
    model in process, or no off-task prompts); the off-task set and its base continuations are
    made at its first use."""
    if (budget is None and ratio is None) or model is None or not s.drift.prompts:
        return None
    anchor: list[AnchorSet] = []  # built once, at the first KL asked for

    def kl_of(points: Population) -> np.ndarray:
        from essa.es.drift_budget import population_kl

        if not anchor:
            anchor.append(report_anchor_set(s, cache, model, tokenizer, adapter))
        return population_kl(model, adapter, anchor[0], points, s.micro_batch_size)

    return KLPromise(budget, kl_of, adapter.stds(), comm, ratio=ratio)


def report_anchor_set(
    s: DriftSettings, cache: ContinuationCache, model: Any, tokenizer: Any, adapter: SVDAdapter
) -> AnchorSet:
    """The drift report's off-task set as an anchor set: its prompts in the run's template,
    the base model's continuations from the run's cache (the report reads the same entry)."""
    from essa.drift.models import PopulationModels
    from essa.drift.offtask import rendered_offtask_prompts
    from essa.es.drift_budget import anchor_on

    prompts = rendered_offtask_prompts(s.data, s.drift.prompts, tokenizer)
    models = PopulationModels(model, tokenizer, adapter, np.zeros(adapter.dim), s.micro_batch_size)
    return anchor_on(
        model, tokenizer, prompts, cache.continuations(models, prompts, s.drift.tokens)
    )


def held_account(
    held: Held, budget: float, val: Sequence[float] | None = None, ratio: float | None = None
) -> dict[str, Any]:
    """The summary's ``exported.kl_budget``: the promise (``ratio``: set as that multiple of
    the SFT adapter's own KL), where the point was held and the KL before and after (``val``:
    validation before and after, when holding moved the point)."""
    out: dict[str, Any] = {
        "budget": budget,
        **({"sft_multiple": ratio} if ratio is not None else {}),
        "kl_before": held.kl_before,
        "kl": held.kl,
        "path_u": held.u,
        "held": held.kl <= budget,
        "how": (
            "within the budget as chosen"
            if not held.moved
            else "moved along base -> start -> point to the furthest point within the budget"
        ),
    }
    if val is not None:
        out["val_before"], out["val_after"] = float(val[0]), float(val[1])
        out["val_cost"] = float(val[0]) - float(val[1])
    return out
