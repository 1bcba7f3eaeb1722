"""Fitness of a population on a prompt mini-batch, its fault counts and the generation record.

numpy only: the evaluator (an :class:`essa.protocols.Evaluator`) does the generating.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from essa import seeding
from essa.config import DataConfig, GenerationConfig, RewardConfig, RunConfig
from essa.dist import Comm
from essa.errors import UserError
from essa.es.signal import nan_mean, signal_record, split_half
from essa.protocols import (
    Evaluator,
    LogprobEvaluator,
    ReferenceForcingEvaluator,
    ReferenceScorer,
    RowProgress,
)
from essa.rewards.base import DrawKey, Reward
from essa.rewards.fitness import KeyGather, candidate_scores
from essa.rewards.logprob import COMPLETION_LOGPROBS, REFERENCE_LOGPROBS
from essa.types import AdapterVector, Example, Fitness, Population

if TYPE_CHECKING:
    from essa.data.selection import Informative
    from essa.harness import Phase


# Where an ESSA run scores with its training reward: the second element of a draw key.
GENERATION_SITE, SCALE_BASELINE_SITE = 0, 1


def draw_keys(
    seed: int, site: Sequence[int], prompt_ids: Sequence[int], candidates: range, k: int
) -> list[list[DrawKey]]:
    """Per candidate (population indices ``candidates``), its items' draw keys in the
    prompt-major layout: ``(seed, *site, prompt, candidate, sample)``. They say where an item
    sits in the run, so a random reward scores a candidate the same on any rank and shard.

    >>> draw_keys(7, (0, 3), [12, 5], range(2, 3), 1)
    [[(7, 0, 3, 12, 2, 0), (7, 0, 3, 5, 2, 0)]]
    """
    return [[(seed, *site, p, c, j) for p in prompt_ids for j in range(k)] for c in candidates]


def minibatch(n: int, size: int, seed: int, generation: int) -> np.ndarray:
    """The generation's shared prompt indices: a pure function of (seed, generation)."""
    rng = seeding.rng(seed, "es.minibatch", generation)
    return rng.choice(n, size=min(size, n), replace=False)


def scores(
    reward: Reward,
    evaluator: Evaluator,
    texts: list[list[str]],
    answers: list[str | None],
    prompts: list[str],
    *,
    population: Population | None = None,
    samples: int = 1,
    comm: KeyGather | None = None,
    keys: Sequence[Sequence[DrawKey]] | None = None,
) -> tuple[list[list[float | None]], dict[str, float]]:
    """Per candidate, the reward of each of its ``len(prompts) * samples`` completions, and the
    population pool's metrics (essa.rewards.fitness). Log-prob rewards take the backend's:
    the generated tokens' (``last_logprobs``) or the reference's, teacher-forced under each
    candidate of ``population`` (this rank's shard)."""
    logprobs = None
    if COMPLETION_LOGPROBS in reward.needs:
        # load_reward admits log-prob rewards only on a backend that returns the log-probs.
        assert isinstance(evaluator, LogprobEvaluator)
        logprobs = evaluator.last_logprobs
    elif REFERENCE_LOGPROBS in reward.needs:
        assert isinstance(evaluator, ReferenceScorer) and population is not None
        refs = [a or "" for a in answers for _ in range(samples)]
        logprobs = evaluator.reference_logprobs(
            population, [p for p in prompts for _ in range(samples)], refs
        )
    return candidate_scores(
        reward,
        texts,
        answers,
        prompts,
        samples_per_prompt=samples,
        logprobs=logprobs,
        comm=comm,
        keys=keys,
    )


def fault_counts(reward: Reward, evaluator: Evaluator) -> dict[str, int]:
    """Running fault counters of this rank (reward timeouts and errors, non-finite logits)."""
    stats = reward.stats.as_dict()
    return {
        "reward_timeouts": stats["n_timeout"],
        "reward_errors": stats["n_error"],
        "nonfinite_candidates": int(evaluator.nonfinite.sum()),
    }


def fault_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    delta = {key: after[key] - before[key] for key in ("reward_timeouts", "reward_errors")}
    delta["nonfinite_candidates"] = after["nonfinite_candidates"]  # a per-call count already
    return delta


def check_generation(g: int, fitness: Fitness, faults: dict[str, int], reward: str) -> None:
    """Stop with one clear line when every candidate of generation g failed (NaN fitness).

    Nothing is told to the optimizer, so the last checkpoint stays the state to resume from.
    Every rank sees the same gathered fitness and stops together. The counts are this rank's.
    """
    if not np.all(np.isnan(fitness)):
        return
    raise UserError(
        f"generation {g}: all {fitness.size} candidates failed (NaN fitness): reward "
        f"{reward!r} timed out on {faults['reward_timeouts']} and failed on "
        f"{faults['reward_errors']} items, {faults['nonfinite_candidates']} candidates had "
        "non-finite logits; fix the reward or reward.timeout_seconds and resume with "
        "essa train --resume"
    )


def track_best(state: dict[str, Any], population: Population, fitness: Fitness) -> None:
    """Keep the best candidate seen so far in ``state`` (best_fitness, best_vector)."""
    if np.all(np.isnan(fitness)):
        return
    i = int(np.nanargmax(fitness))
    if state["best_fitness"] is None or fitness[i] > state["best_fitness"]:
        state["best_fitness"] = float(fitness[i])
        state["best_vector"] = population[i].tolist()


def tool_metrics(evaluator: Evaluator, prefix: str = "") -> dict[str, float]:
    """Tool use since the last call (tool_calls_per_row, tool_error_rate, tool_rows,
    tool_output_used; essa.tools.turns.ToolTally), ``prefix`` on the names; empty for an
    evaluator without tools. Rank-local under MPI: each rank runs its own rows' calls."""
    take = getattr(evaluator, "take_tool_metrics", None)
    return {} if take is None else {prefix + k: v for k, v in take().items()}


def generation_record(
    g: int,
    fitness: Fitness,
    opt_metrics: dict[str, float],
    seconds: float,
    tokens: int,
    evaluator: Evaluator,
) -> dict[str, Any]:
    """Generation g's metrics.jsonl line: fitness statistics, speed, the optimizer's view."""
    finite = fitness[np.isfinite(fitness)]
    record: dict[str, Any] = {
        "generation": g,
        "best_fitness": float(finite.max()) if finite.size else None,
        "mean_fitness": float(finite.mean()) if finite.size else None,
        "median_fitness": float(np.median(finite)) if finite.size else None,
        "n_failed": int(fitness.size - finite.size),
        "seconds": round(seconds, 4),
        "new_tokens": tokens,
        "tokens_per_second": round(tokens / seconds, 1) if seconds > 0 else None,
    }
    # The optimizer's own view (sigma, grad norms, skipped generations); fitness is already above.
    record.update(
        {
            k: float(v)
            for k, v in opt_metrics.items()
            if k not in record and k != "generation" and not k.startswith("fitness_")
        }
    )
    if evaluator.chosen:
        record["strategy"] = ",".join(sorted(set(evaluator.chosen.values())))
    return record


def heldout_texts(
    evaluator: Evaluator,
    vector: AdapterVector,
    prompts: list[str],
    progress: RowProgress | None = None,
) -> list[str]:
    """Greedy completions of one candidate on the held-out prompts (scored by the harness),
    whatever the training's sampling temperature: the reported accuracy is always greedy."""
    (texts,) = evaluator.completions(
        np.asarray(vector)[None, :], prompts, progress=progress, greedy=True
    )
    return texts


@dataclass(frozen=True)
class FitnessSettings:
    """What one generation's fitness reads of the config."""

    seed: int  # run.seed: the prompt mini-batch, the sampling and the reward draws
    batch_size: int  # data.batch_size: prompts per generation, shared by all candidates
    samples_per_prompt: int = 1  # generation.samples_per_prompt: completions per prompt
    reference_weight: float = 0.0  # reward.reference_weight: the dense tie-breaker's weight
    reference_signal: str = "likelihood"  # reward.reference_signal: what it reads per token

    @classmethod
    def of(
        cls, run: RunConfig, data: DataConfig, generation: GenerationConfig, reward: RewardConfig
    ) -> FitnessSettings:
        return cls(
            run.seed,
            data.batch_size,
            generation.samples_per_prompt,
            reward.reference_weight,
            reward.reference_signal,
        )


def shard_fitness(
    settings: FitnessSettings,
    g: int,
    population: Population,
    evaluator: Evaluator,
    train: list[Example],
    train_prompts: list[str],
    reward: Reward,
    comm: Comm,
    rows: Callable[[int], Phase] | None = None,
    informative: Informative | None = None,
    references: Sequence[str | None] | None = None,
) -> tuple[Fitness, dict[str, float]]:
    """Evaluate this rank's shard on generation g's shared prompts; all-gather the fitness.

    With ``informative`` (data.selection / data.hints) the shared prompts skip the predicted
    uninformative ones and carry hints; every candidate still answers the same prompts.
    ``references`` (one per ``train`` item) replace the answers as the tie-breaker's reference
    (tool-integrated rollouts score their code-call target, essa.data.tool_sft).
    """
    from essa.dist import shard
    from essa.rewards import fitness_from_rewards

    idx = minibatch(len(train), settings.batch_size, settings.seed, g).tolist()
    if informative is None:
        prompts = [train_prompts[i] for i in idx]
    else:
        idx = informative.draw(idx, len(train), (g,))
        prompts = informative.prompts(idx, train, train_prompts)
    answers = [train[i].answer for i in idx]
    span = shard(len(population), comm.rank, comm.world_size)
    mine = population[span]
    seed = settings.seed * 100_003 + g
    k = settings.samples_per_prompt
    weight = settings.reference_weight
    # The dense tie-breaker rides in the generation's prefill (load_reward admits it on HF only).
    extra: dict[str, Any] = {}
    if weight:
        assert isinstance(evaluator, ReferenceForcingEvaluator)
        extra["references"] = answers if references is None else [references[i] for i in idx]
    if rows is None:
        texts = evaluator.completions(mine, prompts, seed=seed, samples=k, **extra)
    else:
        with rows(len(mine) * len(prompts) * k) as bar:
            texts = evaluator.completions(mine, prompts, seed, bar.advance, samples=k, **extra)
    keys = draw_keys(settings.seed, (GENERATION_SITE, g), idx, range(span.start, span.stop), k)
    graded, pool = scores(
        reward,
        evaluator,
        texts,
        answers,
        prompts,
        population=mine,
        samples=k,
        comm=comm,
        keys=keys,
    )
    local = np.array([fitness_from_rewards(s) for s in graded])
    local[evaluator.nonfinite] = np.nan  # NaN/inf logits: graded text would be garbage
    local[~np.isfinite(local)] = np.nan  # +-inf fitness is a failed evaluation too
    # Every rank holds the same (P, N) per-prompt rewards: the signal of the ranking
    # (essa.es.signal) and the informative prompts' histories read them.
    values = prompt_values(graded, len(idx), k, evaluator.nonfinite)  # (p, N)
    gathered = comm.allgather_fitness(values.ravel()).reshape(-1, len(idx))  # (P, N)
    if informative is not None:
        informative.observe(idx, gathered.T)
    # (P,) float64: with the per-prompt rewards and the pool's 8-byte answer keys, the only
    # data crossing ranks
    reward_fitness = comm.allgather_fitness(local)
    metrics = {
        **signal_metrics(reward_fitness, len(prompts)),
        **signal_record(reward_fitness, gathered, settings.seed, g),
    }
    if not weight:
        return reward_fitness, {**pool, **metrics}
    assert isinstance(evaluator, ReferenceForcingEvaluator)
    logprobs = evaluator.last_reference_logprobs
    dense = reference_term(logprobs)  # (p,)
    fitness = comm.allgather_fitness(local + weight * dense)
    name = "reference_logprob" if settings.reference_signal == "likelihood" else "reference_margin"
    metrics[name] = float(np.nanmean(comm.allgather_fitness(dense)))
    # The search ranks by reward + weight x tie-breaker: the signal is that ranking's reliability
    # (the reward's alone stays in `reward_signal`).
    ranked = ranked_values(values, reference_terms(logprobs, len(idx) * k), weight, k)  # (p, N)
    gathered_ranked = comm.allgather_fitness(ranked.ravel()).reshape(-1, len(idx))  # (P, N)
    metrics["signal"] = round(split_half(gathered_ranked, settings.seed, g), 4)
    return fitness, {**pool, **metrics}


def ranked_values(values: np.ndarray, terms: np.ndarray, weight: float, k: int) -> np.ndarray:
    """(p, N) per prompt, what the fitness adds up: the reward ``values`` (p, N) plus ``weight``
    x the tie-breaker's term of the prompt, the mean over its k samples of ``terms`` (p, N*k);
    a prompt without a reference adds the reward alone.

    >>> ranked_values(np.array([[1.0, 0.0]]), np.array([[-1.0, np.nan]]), 0.5, 1).tolist()
    [[0.5, 0.0]]
    """
    dense = nan_mean(terms.reshape(values.shape[0], values.shape[1], k))  # (p, N)
    return values + weight * np.where(np.isfinite(dense), dense, 0.0)


def reference_term(logprobs: list[list[list[float]]]) -> np.ndarray:
    """(P,) per candidate: the mean over items of the reference's mean token log-prob, i.e. the
    length-normalised log-likelihood of the right answer, or with ``reward.reference_signal:
    margin`` its mean margin to the greedy choice (items without one are left out).

    >>> reference_term([[[-1.0, -3.0], []], [[-0.5], [-1.5]]]).tolist()
    [-2.0, -1.0]
    """
    out = []
    for items in logprobs:
        means = [sum(t) / len(t) for t in items if t]
        out.append(sum(means) / len(means) if means else np.nan)
    return np.array(out, dtype=np.float64)


def reference_terms(logprobs: list[list[list[float]]], n: int) -> np.ndarray:
    """(P, n): each candidate's term on each of its ``n`` items (the reference's mean token
    log-prob, or margin), NaN for an item without a reference; :func:`reference_term` is the
    row mean over the items that have one.

    >>> reference_terms([[[-1.0, -3.0], []], [[-0.5], [-1.5]]], 2).tolist()
    [[-2.0, nan], [-0.5, -1.5]]
    """
    out = np.full((len(logprobs), n), np.nan)
    for c, items in enumerate(logprobs):
        for i, tokens in enumerate(items):
            if tokens:
                out[c, i] = sum(tokens) / len(tokens)
    return out


def signal_metrics(fitness: Fitness, n_prompts: int) -> dict[str, float]:
    """How much the reward separates the population, in prompts of this generation's batch:
    best minus mean (the margin the ranking rests on) and the spread across candidates. A
    margin of one or two prompts out of 32 is mostly noise (the SmolLM2 runs of docs/real-model.md)."""
    finite = fitness[np.isfinite(fitness)]
    if finite.size == 0:
        return {}
    return {
        "margin_prompts": float((finite.max() - finite.mean()) * n_prompts),
        "spread_prompts": float(finite.std() * n_prompts),
        "reward_flat": float(reward_is_flat(fitness)),
    }


def reward_is_flat(fitness: Fitness) -> bool:
    """Hansen's flat-fitness test (purecmaes.m): the best value equals the ceil(0.7 P)-th best,
    i.e. the reward cannot rank the top 70% of the P candidates. Failed (NaN) candidates count
    as worst. Equality allows a relative 1e-12: equal means summed in another order may differ
    in the last bit.

    >>> reward_is_flat(np.array([0.5] * 12 + [0.25] * 4)), reward_is_flat(np.array([1.0, 0.5]))
    (True, False)
    """
    ranked = np.sort(np.where(np.isnan(fitness), -np.inf, fitness))[::-1]  # best first
    kth = ranked[math.ceil(0.7 * fitness.size) - 1]
    return bool(np.isfinite(kth) and abs(ranked[0] - kth) <= 1e-12 * max(1.0, abs(kth)))


def prompt_values(
    graded: list[list[float | None]], num_prompts: int, k: int, nonfinite: np.ndarray
) -> np.ndarray:
    """(p, N): each candidate's mean reward over its k samples of each prompt (NaN where none
    is gradable, or the candidate had non-finite logits)."""
    rewards = np.array(
        [[np.nan if r is None else float(r) for r in row] for row in graded], dtype=np.float64
    ).reshape(len(graded), num_prompts, k)  # (p, N, k)
    values = nan_mean(rewards)  # (p, N)
    values[np.asarray(nonfinite, dtype=bool)] = np.nan
    return values
