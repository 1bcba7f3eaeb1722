"""The no-search baseline: the SFT adapter uniformly scaled, the factor chosen on training prompts.

It answers "is ES doing more than turning the adapter up?" (ESSA spec §4).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from essa import seeding
from essa.dist import Comm
from essa.protocols import Evaluator, RowProgress
from essa.rewards import fitness_from_rewards
from essa.rewards.base import Reward
from essa.types import AdapterVector, Example

if TYPE_CHECKING:
    from essa.adapters.svd import SVDAdapter

SCALE_FACTORS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
SCALE_PROMPTS = 256


def scale_vector(adapter: SVDAdapter, factor: float) -> AdapterVector:
    """Offsets that scale every module's delta-W uniformly by ``factor`` (s_B -> factor * s_B).

    With adapter.alpha < 1 only the searched singular values scale, so this is approximate.
    """
    x = np.zeros(adapter.dim)
    for module in adapter.modules:
        x[module.slice_b] = (factor - 1.0) * np.asarray(module.s_b[: module.k])
    return x


def preferred_factor(fitness: np.ndarray, factors: Sequence[float] = SCALE_FACTORS) -> int:
    """Index of the best of ``factors`` by ``fitness`` (one per factor); among factors tied at the best,
    the one closest to x1 in log scale: a reward that cannot tell them apart (all right, or all
    wrong) is no reason to move off the SFT adapter.

    >>> preferred_factor(np.array([1.0, 1.0, 1.0, 0.5, 1.0, 0.0, 0.0, 0.0]))
    1
    >>> preferred_factor(np.array([0.2, 0.3, 0.3, 0.9, 0.9, 0.1, np.nan, 0.0]))
    3
    """
    top = np.nanmax(fitness)
    tied = [i for i, f in enumerate(fitness) if np.isfinite(f) and abs(f - top) <= 1e-12]
    return min(tied, key=lambda i: abs(math.log(factors[i])))


def scale_baseline(
    evaluator: Evaluator,
    adapter: SVDAdapter,
    train: list[Example],
    prompts: list[str],
    reward: Reward,
    seed: int,
    heldout: Callable[[AdapterVector], float] | None,
    progress: RowProgress | None = None,
    samples: int = 1,
    comm: Comm | None = None,
    prompts_used: int = SCALE_PROMPTS,
    references: Sequence[str | None] | None = None,
    reference_weight: float = 1.0,
) -> dict[str, Any] | None:
    """Score SCALE_FACTORS on up to ``prompts_used`` training prompts; the best one's held-out
    score when ``heldout`` is given (a budgeted run's start needs only the factor).

    With ``references`` (one per ``train`` item: reward.reference_weight's references, on an
    evaluator that teacher-forces them) the same prefill reads the tie-breaker of every
    factor, and the result's ``reference_check`` says whether the fitness with it
    (``reference_weight``) picks factors the reward rates as well (:func:`reference_check`).

    Under MPI the factors are sharded across ranks like a population (every rank busy); only
    their fitness (and a population pool's answer keys) is gathered, so the choice is the
    same for any rank count. Every rank must call it.
    """
    from essa.dist import LocalComm, shard
    from essa.es.generation import (
        SCALE_BASELINE_SITE,
        draw_keys,
        prompt_values,
        reference_terms,
        scores,
    )
    from essa.es.signal import nan_mean

    comm = comm or LocalComm()

    rng = seeding.rng(seed, "es.scale_baseline")
    idx = rng.choice(len(train), size=min(prompts_used, len(train)), replace=False)
    batch = [prompts[i] for i in idx]
    answers = [train[i].answer for i in idx]
    population = np.stack([scale_vector(adapter, f) for f in SCALE_FACTORS])  # (8, D)
    span = shard(len(population), comm.rank, comm.world_size)
    mine = population[span]
    # Called on a rank with no factor too (more ranks than factors): it returns no texts and
    # clears the evaluator's per-call outputs (log-probs) the reward reads after it.
    extra: dict[str, Any] = {}
    if references is not None:
        extra["references"] = [references[i] for i in idx]
    texts = evaluator.completions(
        mine, batch, seed=seed, progress=progress, samples=samples, **extra
    )
    dense = None
    if references is not None:  # (p, N) this rank's factors' tie-breaker terms per prompt
        rows = reference_terms(evaluator.last_reference_logprobs, len(batch) * samples)  # type: ignore[attr-defined]
        dense = nan_mean(rows.reshape(len(mine), len(batch), samples))  # over the k samples
    keys = draw_keys(
        seed, (SCALE_BASELINE_SITE,), idx.tolist(), range(span.start, span.stop), samples
    )
    graded, _ = scores(
        reward,
        evaluator,
        texts,
        answers,
        batch,
        population=mine,
        samples=samples,
        comm=comm,
        keys=keys,
    )
    local = np.array([fitness_from_rewards(s) for s in graded], dtype=np.float64)
    fitness = comm.allgather_fitness(local)  # (8,) in factor order
    if np.all(np.isnan(fitness)):  # the reward failed everywhere: no baseline to report
        return None
    best = preferred_factor(fitness)
    result: dict[str, Any] = {
        "factor": SCALE_FACTORS[best],
        "train_fitness": float(fitness[best]),
        "prompts": len(batch),
    }
    if dense is not None:
        values = prompt_values(graded, len(batch), samples, evaluator.nonfinite)  # (p, N)
        per_prompt = comm.allgather_fitness(values.ravel()).reshape(-1, len(batch))  # (8, N)
        terms = comm.allgather_fitness(dense.ravel()).reshape(-1, len(batch))  # (8, N)
        result["reference_check"] = reference_check(per_prompt, terms, reference_weight)
    if heldout is not None:
        result["heldout_accuracy"] = heldout(population[best])
    return result


def reference_check(
    per_prompt: np.ndarray,
    dense: np.ndarray,
    weight: float,
    factors: Sequence[float] = SCALE_FACTORS,
) -> dict[str, Any]:
    """Does adding the tie-breaker to the fitness pick better factors by the reward?

    ``per_prompt`` (F, N) is each of ``factors``' reward on each prompt and ``dense`` (F, N)
    its tie-breaker term there (NaN where the prompt has no reference). Two-fold
    cross-validation over the prompts (even and odd ones): on one half a factor is chosen by
    the reward alone (:func:`preferred_factor`) and by the search's fitness, reward +
    ``weight`` x term; each choice is scored by the reward on the other half. The tie-breaker
    ``agrees`` unless the fitness with it scores lower than the reward alone: it then rewards
    something the reward does not (a reference's spelling that right answers need not share,
    or plain sharpening). Choosing and scoring on different prompts keeps the reward's own
    choice from winning by its luck on the prompts that chose it. A term that is NaN
    everywhere (no reference scored) or fewer than two prompts agree: nothing to check.

    >>> reward = np.array([[1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]])  # factors 0.5, 1
    >>> check = reference_check(reward, np.array([[-3.0] * 4, [-0.4] * 4]), 1.0)
    >>> check["agrees"], check["factor"], check["reward_with"], check["reward_without"]
    (False, 1.0, 0.25, 0.75)
    """
    from essa.es.signal import nan_mean

    n = per_prompt.shape[1]
    if n < 2 or not np.isfinite(dense).any():
        return {"agrees": True, "factor": None, "reward_with": None, "reward_without": None}

    def choose(cols: np.ndarray, with_term: bool) -> int:
        fitness = nan_mean(per_prompt[:, cols])  # (F,)
        if with_term:
            fitness = fitness + weight * np.nan_to_num(nan_mean(dense[:, cols]))
        return preferred_factor(fitness, factors)

    halves = (np.arange(n) % 2 == 0, np.arange(n) % 2 == 1)
    scores = {True: 0.0, False: 0.0}
    for pick, score in (halves, halves[::-1]):
        for with_term in scores:
            scores[with_term] += float(nan_mean(per_prompt[choose(pick, with_term), score])) / 2
    return {
        "agrees": scores[True] >= scores[False],
        "factor": factors[choose(np.ones(n, dtype=bool), True)],  # the fitness's pick on all
        "reward_with": round(scores[True], 6),
        "reward_without": round(scores[False], 6),
    }


def scale_rows(
    train: list[Example], rank: int = 0, world_size: int = 1, prompts: int = SCALE_PROMPTS
) -> int:
    """Rows (candidate x prompt completions) the scale baseline generates on ``rank``."""
    from essa.dist import shard

    mine = shard(len(SCALE_FACTORS), rank, world_size)
    return (mine.stop - mine.start) * min(prompts, len(train))
