"""A drift budget the search honours: off-task KL and an anchor to the SFT point in the fitness.

``optimizer.drift_budget`` (docs/drift-control.md). ES needs no gradient
of what it ranks, so drift can be priced or forbidden directly:

* **KL penalty**: ``f_c -= kl_penalty * KL_c``, where ``KL_c`` is the mean per-token
  KL(base || candidate c) teacher-forced on a small anchor set (the first off-task prompts of
  :func:`essa.drift.offtask.offtask_prompts` with the base model's greedy continuations), the
  figure the drift report leads with. The base model's log-probs are computed once; each
  generation runs one population-batched forward of all candidates' anchor rows (rows carry
  candidates, as in the generation itself).
* **KL budget**: a candidate with ``KL_c > kl_budget`` ranks below every candidate within it,
  and those over it rank by their KL (Deb's feasibility rule; CMA-ES reads only ranks, OpenAI-ES
  centered ranks). ``kl_budget_sft: r`` sets it to r x the SFT adapter's own KL on the anchor
  set, measured once before the search.
* **Anchor** (the ES form of anchored weight decay): ``f_c -= anchor * mean_i (x_ci / s_i)^2``
  over the searched coordinates, with ``x`` the offsets from the SFT singular values ``s``. ES
  follows the gradient of the Gaussian-smoothed fitness, and smoothing ``||x / s||^2`` keeps its
  gradient ``2 x / s^2`` at the mean: the term pulls the search distribution back toward the SFT
  adapter as weight decay pulls weights toward their initial values.

Every rank computes the KL of its own candidates and all-gathers it, as it does the fitness.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from essa.config import DataConfig, DriftBudgetConfig
from essa.types import Fitness, Population

if TYPE_CHECKING:
    from essa.adapters.svd import SVDAdapter
    from essa.dist import Comm
    from essa.drift.models import Pair


@dataclass
class AnchorSet:
    """The anchor pairs and the base model's next-token log-probs on them."""

    pairs: list[Pair]  # (prompt ids, base continuation ids)
    base_logp: torch.Tensor  # (A, tail, V) float32
    mask: torch.Tensor  # (A, tail) bool: the positions that count
    pad_id: int

    @property
    def positions(self) -> int:
        return int(self.mask.sum())


@dataclass
class DriftBudget:
    """``optimizer.drift_budget`` applied to a generation's gathered fitness."""

    config: DriftBudgetConfig  # kl_budget resolved where kl_budget_sft sets it (drift_budget)
    scale: np.ndarray  # (D,) SFT singular values, 0 where a coordinate is not searched
    anchor_set: AnchorSet | None = None  # None: no KL term
    model: Any = None  # the bare base model
    adapter: SVDAdapter | None = None
    micro_batch_size: int = 128

    def kl(self, population: Population) -> np.ndarray:
        """(p,) mean per-token KL(base || candidate) on the anchor set."""
        assert self.anchor_set is not None and self.adapter is not None
        return population_kl(
            self.model, self.adapter, self.anchor_set, population, self.micro_batch_size
        )

    def apply(
        self, population: Population, fitness: Fitness, comm: Comm
    ) -> tuple[Fitness, dict[str, float]]:
        """The shaped (P,) fitness and the generation's drift-budget metrics: this rank
        computes its own candidates' KL (the shard of the generation) and gathers the rest."""
        from essa.dist import shard

        kl = None
        if self.anchor_set is not None:
            span = shard(len(population), comm.rank, comm.world_size)
            kl = comm.allgather_fitness(self.kl(population[span]))  # (P,)
        return shape(fitness, population, self.config, self.scale, kl)

    def describe(self) -> str:
        """One line for the log: the terms on, and the SFT adapter's own anchor-set KL."""
        d, parts = self.config, []
        if d.anchor:
            parts.append(f"anchor {d.anchor:g} x mean((x/s)^2)")
        if self.anchor_set is not None:
            sft = float(self.kl(np.zeros((1, len(self.scale))))[0])
            parts.append(
                f"anchor set {len(self.anchor_set.pairs)} prompts, "
                f"{self.anchor_set.positions} positions, KL(base||SFT) {sft:.4f}"
            )
            if d.kl_penalty:
                parts.append(f"fitness -= {d.kl_penalty:g} x KL")
            if d.kl_budget is not None:
                over = " (the SFT adapter is over it)" if sft > d.kl_budget else ""
                units = f" ({d.kl_budget_sft:g}x the SFT adapter's)" if d.kl_budget_sft else ""
                parts.append(f"KL budget {d.kl_budget:.4g}{units}{over}")
        return "drift budget: " + "; ".join(parts)


def shape(
    fitness: Fitness,
    population: Population,
    d: DriftBudgetConfig,
    scale: np.ndarray,
    kl: np.ndarray | None,
) -> tuple[Fitness, dict[str, float]]:
    """Penalties and the budget rule on (P,) fitness; NaN (failed) stays NaN.

    >>> d = DriftBudgetConfig(kl_budget=0.5, anchor=1.0)
    >>> f, m = shape(np.array([1.0, 0.9, np.nan]), np.array([[1.0], [0.0], [0.0]]), d,
    ...              np.array([2.0]), np.array([0.7, 0.1, 0.2]))
    >>> f.round(3).tolist(), m["over_kl_budget"]
    ([-0.3, 0.9, nan], 1.0)
    """
    out = np.array(fitness, dtype=np.float64)
    metrics: dict[str, float] = {}
    if d.anchor:
        searched = scale > 0
        relative = population[:, searched] / scale[searched]  # (P, d)
        penalty = d.anchor * np.mean(relative**2, axis=1) if searched.any() else 0.0
        out = out - penalty
        metrics["anchor_penalty_mean"] = float(np.mean(penalty))
    if kl is None:
        return out, metrics
    metrics.update(anchor_kl_mean=float(np.nanmean(kl)), anchor_kl_max=float(np.nanmax(kl)))
    out = out - d.kl_penalty * kl
    if d.kl_budget is not None:
        over = kl > d.kl_budget
        metrics["over_kl_budget"] = float(over.sum())
        out = _feasible_first(out, kl - d.kl_budget, over)
    return out, metrics


def _feasible_first(fitness: Fitness, excess: np.ndarray, over: np.ndarray) -> Fitness:
    """Candidates ``over`` the budget below every other finite one, ordered by ``excess``."""
    if not over.any():
        return fitness
    within = fitness[~over & np.isfinite(fitness)]
    floor = float(within.min()) if within.size else 0.0
    out = fitness.copy()
    keep = over & np.isfinite(fitness)
    out[keep] = floor - 1.0 - excess[keep]
    return out


@torch.no_grad()
def anchor_set(
    model: Any, tokenizer: Any, prompts: list[str], tokens: int, micro_batch_size: int
) -> AnchorSet:
    """The base model's greedy continuations of ``prompts`` and its log-probs on them."""
    from essa.backends.generate import generate_texts
    from essa.config import GenerationConfig

    gen = GenerationConfig(max_new_tokens=tokens, temperature=0.0)
    continuations, _ = generate_texts(
        model, tokenizer, prompts, gen, micro_batch_size=micro_batch_size
    )
    return anchor_on(model, tokenizer, prompts, continuations)


@torch.no_grad()
def anchor_on(
    model: Any, tokenizer: Any, prompts: list[str], continuations: list[str]
) -> AnchorSet:
    """The anchor set of ``prompts`` and the base model's ``continuations`` of them: the pairs
    and the base model's log-probs at the continuation positions."""
    from essa.backends.teacher import encode_pairs
    from essa.drift.models import tail_logp
    from essa.drift.offtask import tail_mask

    pairs = encode_pairs(tokenizer, prompts, continuations)
    base_logp = tail_logp(model, pairs, tokenizer.pad_token_id)  # (A, tail, V)
    mask = tail_mask(pairs, base_logp.shape[1])
    return AnchorSet(pairs, base_logp, mask, tokenizer.pad_token_id)


@torch.no_grad()
def population_kl(
    model: Any,
    adapter: SVDAdapter,
    anchor: AnchorSet,
    population: Population,
    micro_batch_size: int,
) -> np.ndarray:
    """(p,) per candidate, mean per-token KL(base || candidate) over the anchor positions; one
    forward per chunk of candidates, each row carrying its candidate's offsets."""
    from essa.adapters import PopulationLoRA, candidate_rows
    from essa.drift.models import tail_logp
    from essa.drift.offtask import token_kl

    a = len(anchor.pairs)
    per_chunk = max(1, micro_batch_size // a)
    out = np.zeros(len(population), dtype=np.float64)
    with PopulationLoRA(model, adapter) as pop:
        for start in range(0, len(population), per_chunk):
            chunk = population[start : start + per_chunk]  # (c, D)
            pop.set_population(chunk)
            pop.set_rows(candidate_rows(len(chunk), a))
            logp = tail_logp(model, anchor.pairs * len(chunk), anchor.pad_id)  # (c * A, tail, V)
            logp = logp.view(len(chunk), a, *logp.shape[1:])  # (c, A, tail, V)
            kl = token_kl(anchor.base_logp.unsqueeze(0), logp)  # (c, A, tail)
            sums = (kl * anchor.mask).double().sum((1, 2))  # (c,)
            out[start : start + len(chunk)] = (sums / anchor.positions).numpy()
    return out


def drift_budget(
    d: DriftBudgetConfig,
    data: DataConfig,
    micro_batch_size: int,
    model: Any,
    tokenizer: Any,
    adapter: SVDAdapter,
) -> DriftBudget | None:
    """The run's drift budget (None when ``optimizer.drift_budget`` is all off); the anchor set
    is rendered in ``data``'s template and scored ``micro_batch_size`` rows per forward."""
    from essa.drift.offtask import rendered_offtask_prompts

    if not (d.anchor or d.uses_kl):
        return None
    scale = np.where(adapter.searchable(), adapter.stds(), 0.0)
    budget = DriftBudget(d, scale, None, model, adapter, micro_batch_size)
    if d.uses_kl:
        prompts = rendered_offtask_prompts(data, d.prompts, tokenizer)
        budget.anchor_set = anchor_set(model, tokenizer, prompts, d.tokens, micro_batch_size)
    if d.kl_budget_sft is not None:  # in units of the SFT adapter's own KL on this anchor set
        sft = float(budget.kl(np.zeros((1, adapter.dim)))[0])
        budget.config = dataclasses.replace(d, kl_budget=d.kl_budget_sft * sft)
    return budget
