"""ESSA: evolution strategies over the singular values of an SFT LoRA adapter.

The loop (Korotyshova et al., ESSA v3, Alg. 1): ask the population; evaluate every candidate on
the generation's shared prompt mini-batch in one batched pass; fitness = mean reward; tell;
log and checkpoint. Held-out accuracy of the distribution mean is measured every
``evaluation.every`` generations and never feeds back into training. What a run does around
the loop (run directory, signals, budget, progress, summary) is essa/harness.py.

Deviations from the paper (docs/method.md lists them too):
* one common mini-batch per generation (common random numbers) instead of one per candidate;
* greedy decoding by default;
* CMA-ES steps are relative: coordinate i moves in units of its SFT singular value;
* the exported solution is the distribution mean by default (``evaluation.select``), because the
  best candidate's mini-batch score is a lucky draw;
* SFT time is included in the wall time we report (the paper excludes it);
* optional (off by default): the search starts at the no-search baseline's best uniformly
  scaled SFT adapter instead of the SFT adapter (``optimizer.start: scale_baseline``);
* optional (off by default): a dense tie-breaker in the fitness, the reference answer's
  log-likelihood (``reward.reference_weight``), checked against the reward on the scaled
  factors where the scale baseline runs and dropped when they disagree
  (``reward.reference_check``);
* optional (off by default): GRESO prompt skipping and Scaf-GRPO hints on the shared prompts
  (``data.selection``, ``data.hints``; docs/informative-prompts.md), not in the ESSA paper.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from essa.config import Config
from essa.dist import Comm
from essa.es.budget import Budget
from essa.es.generation import (
    FitnessSettings,
    check_generation,
    fault_counts,
    fault_delta,
    generation_record,
    heldout_texts,
    shard_fitness,
    tool_metrics,
    track_best,
)
from essa.es.optimizer import tell
from essa.es.watch import Validate, Watch, open_watch, searched_start, val_prompts
from essa.harness import Harness, Phase
from essa.protocols import Evaluator, Optimizer
from essa.rewards.base import Reward
from essa.rewards.logprob import COMPLETION_LOGPROBS
from essa.types import AdapterVector, Example, Fitness, Population

if TYPE_CHECKING:
    from essa.adapters.svd import SVDAdapter
    from essa.data.selection import Informative
    from essa.data.task import Task
    from essa.es.drift_budget import DriftBudget

Heldout = Callable[..., float]  # (vector, name=..., generation=..., final=...) -> score


def run(
    cfg: Config,
    run_dir: Path,
    *,
    resume: bool = False,
    console: Any = None,
    comm: Comm | None = None,
) -> dict[str, Any]:
    """Train with ESSA; return the summary (also written to ``run_dir/summary.json``).

    Under MPI every rank calls this; rank 0 alone prints, writes the run directory and returns
    the summary (the others return ``{}``).
    """
    from essa import setup
    from essa.adapters.svd import svd_adapter
    from essa.backends import population_evaluator
    from essa.backends.memory import memory_metrics
    from essa.data.selection import informative_prompts
    from essa.data.task import render_splits
    from essa.drift import adapter_pass_figures, adapter_report
    from essa.es import checkpoint
    from essa.es.drift_budget import drift_budget
    from essa.es.optimizer import check_searchable, search_optimizer, start_note
    from essa.rewards.loading import check_vote_size, es_reward_inputs, load_reward

    h, task = setup.open_run(
        cfg, run_dir, resume=resume, console=console, comm=comm, gradient=False
    )
    vllm = cfg.backend == "vllm"  # it returns the sampled tokens' log-probs, not the reference's
    inputs = es_reward_inputs(cfg.reward, cfg.generation, cfg.backend)
    reward = load_reward(cfg.reward, recipe="ESSA", **inputs)
    check_vote_size(cfg.generation, cfg.optimizer.population_size, reward)
    with h:  # the trackers close whatever happens
        cfg, model, tokenizer, base_bytes, lengths = setup.open_model(cfg, h, task)
        train_prompts, test_prompts = render_splits(task, cfg.data, tokenizer)
        budget = Budget.start(
            setup.plan_inputs(cfg), h, resume, lengths, model, tokenizer, task, train_prompts
        )
        peft_model, sft_dir = setup.adapter_on_every_rank(
            cfg, model, tokenizer, task, h, budget.sft_limit(cfg.data, tokenizer, task)
        )
        adapter = svd_adapter(peft_model, cfg.adapter.alpha)
        # before the baseline passes
        check_searchable(cfg.optimizer, adapter, sft_dir, given=bool(cfg.adapter.path))
        base = None if vllm else peft_model.unload()  # the engine loads its own copy of the base
        del model, peft_model
        settings = setup.evaluator_settings(cfg)
        evaluator = population_evaluator(settings, base, tokenizer, adapter, h.comm.world_size)
        evaluator.record_logprobs = COMPLETION_LOGPROBS in reward.needs  # type: ignore[attr-defined]
        evaluator.reference_margin = cfg.reward.reference_signal == "margin"  # type: ignore[attr-defined]
        heldout = functools.partial(_heldout, h, evaluator, task.test, test_prompts)
        val = val_prompts(task, cfg.data, tokenizer)
        validate = functools.partial(_validate, h, evaluator, task.val, val, budget)
        drift = functools.partial(adapter_report, cfg, h, base, tokenizer, adapter, task.test)
        pass_drift = functools.partial(adapter_pass_figures, cfg, base, tokenizer, adapter)
        search_drift = drift_budget(  # None: optimizer.drift_budget is off
            cfg.optimizer.drift_budget, cfg.data, cfg.evaluation.micro_batch_size,
            base, tokenizer, adapter,
        )  # fmt: skip
        if search_drift is not None:
            h.say(search_drift.describe())
        # A resumed run's optimizer has the population its plan gave it (plan.json).
        planned = setup.apply_plan(cfg, budget.adopt(h, None))
        build = functools.partial(search_optimizer, planned.optimizer, cfg.run.seed, adapter)
        opt, loaded = checkpoint.load(run_dir, build) if resume else (None, None)
        state = h.restore(loaded, done=opt.generation if opt is not None else 0)
        if state is None:
            state = _initial_state(
                cfg, h, evaluator, adapter, task, train_prompts, reward, heldout, budget
            )
            h.log(_baseline_record(state, adapter.dim, memory_metrics(base_bytes)))
        batch = cfg.data.batch_size  # as configured: the plan re-sizes prompts up to it
        most = min(batch, len(task.train))
        # The planned candidates and prompts per generation; the tie-breaker as checked.
        cfg = _checked_tie_breaker(setup.apply_plan(cfg, budget.adopt(h, state)), h, state)
        # A fresh run scores the SFT adapter and the start on validation (essa.es.watch).
        watch = open_watch(cfg.run, cfg.optimizer, cfg.reward, h, validate, adapter, state)
        if opt is None:
            opt = search_optimizer(cfg.optimizer, cfg.run.seed, adapter, searched_start(state))
        rows = cfg.optimizer.population_size * cfg.generation.samples_per_prompt
        references = _tool_references(cfg, task.train)
        informative = informative_prompts(
            cfg.data, cfg.run.seed, rows, tokenizer, state.get("informative")
        )
        h.say(
            f"ESSA: D={adapter.dim} singular-value offsets, population "
            f"{cfg.optimizer.population_size}, {cfg.data.batch_size} prompts/generation, "
            f"held-out {h.metric_name} baseline {state['baseline_accuracy']:.3f}"
            + start_note(cfg.optimizer, state.get("scale_baseline"))
        )
        for step in () if watch.stopped else h.steps(opt.generation, show=_shown):
            g = step.index
            record, population, fitness = _generation(
                cfg,
                g,
                opt,
                evaluator,
                task.train,
                train_prompts,
                reward,
                h.comm,
                step.progress,
                informative,
                references,
                search_drift,
            )
            if informative is not None:
                state["informative"] = informative.state_dict()
            track_best(state, population, fitness)
            if g == 0:  # the prompts per generation, re-sized on the search's own rows
                resized = budget.resize_prompts(
                    h, record["seconds"], 1, cfg.run.generations, most, batch
                )
                if resized is not None:
                    cfg, state["plan"] = setup.apply_plan(cfg, resized), resized.as_dict()
            watch.signal(record.get("signal"))
            stop = None
            if h.due(g, cfg.evaluation.every) and watch.validating:
                record.update(_check_mean(watch, validate, opt), **tool_metrics(evaluator, "val_"))
                if h.is_root:  # rank 0 logs the record
                    record.update(pass_drift(opt.mean))
                stop = watch.stop_after_check(g)
            state["search_seconds"] = state.get("search_seconds", 0.0) + record["seconds"]
            state["elapsed"] = h.elapsed
            step.finish(record, lambda: checkpoint.save(run_dir, opt, state), stop)
        state.update(test_size=len(task.test), model_bytes=base_bytes, elapsed=h.elapsed)
        state["max_new_tokens"] = cfg.generation.new_tokens
        return _finish(
            cfg, h, adapter, opt, state, heldout, sft_dir, drift, evaluator, watch, validate
        )


def _heldout(
    h: Harness,
    evaluator: Evaluator,
    examples: list[Example],
    prompts: list[str],
    vector: AdapterVector,
    name: str = "held-out",
    generation: int | None = None,
    final: bool = False,
    items: int | None = None,
) -> float:
    """Held-out score of ``vector`` (never fed back); samples with ``generation``.

    Every rank calls it and generates its shard of the held-out prompts; only per-item scores
    are gathered, so the score is that of one rank (the same sum in the same order). ``items``:
    the first ``items`` of the split only (a budgeted run's checks during the search).
    """
    from essa.dist import shard

    if items is not None:
        examples, prompts = examples[:items], prompts[:items]
    if not examples:
        return float("nan")
    part = shard(len(prompts), h.comm.rank, h.comm.world_size)
    with h.phase(name, part.stop - part.start, unit="rows") as bar:
        texts = heldout_texts(evaluator, vector, prompts[part], bar.advance)
    return h.score_shard(texts, examples, prompts, part, generation, final=final, name=name)


def _validate(
    h: Harness,
    evaluator: Evaluator,
    examples: list[Example],
    prompts: list[str],
    budget: Budget,
    vector: AdapterVector,
    name: str,
) -> list[float]:
    """Per-item validation scores of ``vector`` (the first ``budget.items``: the plan's size
    of a check, read at each call), gathered from every rank's shard in item order; they feed
    the run's choices (essa.es.watch), never the test."""
    from essa.dist import shard
    from essa.evaluation import score_heldout

    examples, prompts = examples[: budget.items], prompts[: budget.items]
    if not examples:
        return []
    part = shard(len(prompts), h.comm.rank, h.comm.world_size)
    with h.phase(f"validation ({name})", part.stop - part.start, unit="rows") as bar:
        texts = heldout_texts(evaluator, vector, prompts[part], bar.advance)
    mine = score_heldout(h.metric, texts, examples[part], prompts[part])[1] if texts else []
    return h.comm.allgather_fitness(np.asarray(mine, dtype=np.float64)).tolist()


def _check_mean(watch: Watch, validate: Validate, opt: Optimizer) -> dict[str, Any]:
    """The search's mean after ``opt.generation`` generations on validation: its record's
    fields (val_accuracy, val_gain, val_se, val_best)."""
    name = f"mean after generation {opt.generation}"
    return watch.observe(name, opt.generation - 1, opt.mean, validate(opt.mean, name))


def _generation(
    cfg: Config,
    g: int,
    opt: Optimizer,
    evaluator: Evaluator,
    problems: list[Example],
    prompts: list[str],
    reward: Reward,
    comm: Comm,
    rows: Callable[[int], Phase] | None = None,
    informative: Informative | None = None,
    references: list[str | None] | None = None,
    search_drift: DriftBudget | None = None,
) -> tuple[dict[str, Any], Population, Fitness]:
    """One ask / evaluate / tell on every rank: the metrics record, population (P, D), fitness (P,)."""
    from essa.dist import check_replicas

    start = time.perf_counter()
    bytes_before, tokens_before = comm.comm_bytes, evaluator.stats.new_tokens
    faults_before = fault_counts(reward, evaluator)
    tool_metrics(evaluator)  # counts from earlier held-out passes are not this generation's
    population = opt.ask()  # (P, D), identical on every rank
    settings = FitnessSettings.of(cfg.run, cfg.data, cfg.generation, cfg.reward)
    fitness, pool = shard_fitness(
        settings, g, population, evaluator, problems, prompts, reward, comm, rows, informative,
        references,
    )  # fmt: skip
    faults = fault_delta(faults_before, fault_counts(reward, evaluator))
    check_generation(g, fitness, faults, reward.name)
    if search_drift is not None:  # optimizer.drift_budget: KL penalty, budget, anchor
        fitness, shaped = search_drift.apply(population, fitness, comm)
        pool = {**pool, **shaped}
    opt_metrics = tell(cfg.optimizer, opt, population, fitness, pool)
    check_replicas(comm, opt, g)  # every rank must now hold the same state
    tokens = evaluator.stats.new_tokens - tokens_before
    seconds = time.perf_counter() - start
    record = generation_record(g, fitness, opt_metrics, seconds, tokens, evaluator)
    record.update(world_size=comm.world_size, comm_bytes=comm.comm_bytes - bytes_before)
    record.update(faults)
    record.update(pool)  # majority_share, answered_share under pool: population
    record.update(tool_metrics(evaluator))  # tool_calls_per_row, ... with tools.python
    if informative is not None:  # prompts_skipped, rows_saved, prompts_hinted, ...
        record.update(informative.end_step())
    return record, population, fitness


def _tool_references(cfg: Config, train: list[Example]) -> list[str | None] | None:
    """With tool calls and the tie-breaker, each training item's code-call target as its
    reference (a tool-using model is not expected to write the bare answer after the prompt);
    None: the answers, as without tools."""
    t = cfg.tools.python
    if not (t.max_tool_calls and t.sft_with_code and cfg.reward.reference_weight):
        return None
    from essa.data.tool_sft import tool_references

    return tool_references(train, t)


def _initial_state(
    cfg: Config,
    h: Harness,
    evaluator: Evaluator,
    adapter: SVDAdapter,
    task: Task,
    train_prompts: list[str],
    reward: Reward,
    heldout: Heldout,
    budget: Budget,
) -> dict[str, Any]:
    """Fresh-run state: the SFT adapter's held-out accuracy and the no-search baseline (and,
    in a budgeted run, the plan re-made with the baseline pass's measured cost)."""
    from essa import setup
    from essa.es.start import scale_baseline, scale_rows

    start = time.perf_counter()
    state: dict[str, Any] = {
        "baseline_accuracy": heldout(np.zeros(adapter.dim), "held-out baseline", -1),
        "best_fitness": None,
        "best_vector": None,
        "elapsed": 0.0,
    }
    seconds = time.perf_counter() - start
    budget.remeasure(setup.plan_inputs(cfg), h, seconds, len(task.test), len(task.train))
    if budget.plan is not None:
        state["plan"] = budget.plan.as_dict()
    if cfg.evaluation.use_scale_baseline or cfg.optimizer.start == "scale_baseline":
        n = budget.start_prompts
        rows = scale_rows(task.train, h.comm.rank, h.comm.world_size, n)
        # A budgeted run reports the chosen factor's held-out score only when asked to.
        report = budget.plan is None or cfg.evaluation.use_scale_baseline
        held_out = _Timed(lambda x: heldout(x, "scale baseline held-out"))
        start = time.perf_counter()
        with h.phase("scale baseline", rows, unit="rows") as bar:
            state["scale_baseline"] = scale_baseline(
                evaluator,
                adapter,
                task.train,
                train_prompts,
                reward,
                cfg.run.seed,
                held_out if report else None,
                progress=bar.advance,
                samples=cfg.generation.samples_per_prompt,
                comm=h.comm,
                prompts_used=n,
                references=_check_references(cfg, task.train),
                reference_weight=cfg.reward.reference_weight,
            )
        seconds = time.perf_counter() - start - held_out.seconds
        inputs = setup.plan_inputs(cfg)
        generated = rows * cfg.generation.samples_per_prompt
        budget.remeasure_search(inputs, h, seconds, generated, len(task.test), len(task.train))
        if budget.plan is not None:
            state["plan"] = budget.plan.as_dict()
    return state


def _check_references(cfg: Config, train: list[Example]) -> list[str | None] | None:
    """The tie-breaker's reference per training item, for the scale baseline to check it
    against the reward (reward.reference_check); None: no tie-breaker, or no check."""
    if not (cfg.reward.reference_weight and cfg.reward.reference_check):
        return None
    return _tool_references(cfg, train) or [ex.answer for ex in train]


def _checked_tie_breaker(cfg: Config, h: Harness, state: dict[str, Any]) -> Config:
    """``cfg`` with the tie-breaker off (reward.reference_weight 0) when, on the scale
    baseline's factors, the fitness with it picks factors the reward rates lower than the
    reward alone does (essa.es.start.reference_check). The check is in the checkpointed
    state, so a resumed run decides the same."""
    from dataclasses import replace

    check = (state.get("scale_baseline") or {}).get("reference_check")
    if check is None or check["factor"] is None:
        return cfg
    line = (
        f"factors chosen on half the training prompts score {check['reward_with']:.3f} on "
        f"the other half with it, {check['reward_without']:.3f} by the reward alone"
    )
    if check["agrees"]:
        h.say(f"reference tie-breaker checked: kept ({line})")
        return cfg
    h.say(f"reference tie-breaker checked: off, the reward alone ranks ({line})")
    return replace(cfg, reward=replace(cfg.reward, reference_weight=0.0))


class _Timed:
    """A held-out pass that adds up its own seconds (the scaled start's rows are timed
    without it)."""

    def __init__(self, heldout: Callable[[AdapterVector], float]) -> None:
        self.heldout = heldout
        self.seconds = 0.0

    def __call__(self, x: AdapterVector) -> float:
        start = time.perf_counter()
        try:
            return self.heldout(x)
        finally:
            self.seconds += time.perf_counter() - start


def _shown(record: dict[str, Any]) -> dict[str, Any]:
    """The loop's console fields."""
    shown = {"fitness mean": record["mean_fitness"], "best": record["best_fitness"]}
    if "signal" in record:
        shown["signal"] = record["signal"]
    if "val_accuracy" in record:
        shown["val"] = record["val_accuracy"]
    return shown


def _baseline_record(
    state: dict[str, Any], dim: int, memory: dict[str, float | int]
) -> dict[str, Any]:
    """metrics.jsonl's first line: the SFT adapter's held-out accuracy (generation -1)."""
    accuracy = state["baseline_accuracy"]
    return {
        "generation": -1,
        "event": "baseline",
        "dim": dim,
        "heldout_accuracy": accuracy,
        **memory,
    }


def _finish(
    cfg: Config,
    h: Harness,
    adapter: SVDAdapter,
    opt: Optimizer,
    state: dict[str, Any],
    heldout: Heldout,
    sft_dir: str,
    drift: Callable[[AdapterVector], dict[str, Any]],
    evaluator: Evaluator,
    watch: Watch,
    validate: Validate,
) -> dict[str, Any]:
    """Evaluate the selected vector on the held-out split (every rank, sharded); rank 0 alone
    measures its drift (essa/drift.py), exports it and writes the summary (the others return
    ``{}``)."""
    from essa.backends.memory import memory_metrics

    vector = np.asarray(opt.mean)
    if cfg.evaluation.select == "best" and state["best_vector"] is not None:
        vector = np.asarray(state["best_vector"])
    if watch.unchecked(opt.generation):  # the search's last mean, past its last check
        _check_mean(watch, validate, opt)
    vector, exported = watch.choice(vector)  # the validated point, or the SFT adapter
    h.say(f"exported: {exported['point']} ({exported['why']})")
    tool_metrics(evaluator)
    final = heldout(vector, "final held-out", opt.generation, final=True)
    tool_use = tool_metrics(evaluator)  # the final pass's: tool_calls_per_row, ...
    if not h.is_root:
        return {}
    if "generations" in h.reporter.planned:  # the loop's phase also holds its held-out checks
        h.reporter.actual["generations"] = state.get("search_seconds", 0.0)
    report = drift(vector)
    adapter_dir = h.run_dir / "adapter"
    with h.phase("export"):
        adapter.export_peft(vector, adapter_dir, base_model_name_or_path=cfg.model.name_or_path)
    summary = h.summary(
        max_new_tokens=state.get("max_new_tokens"),
        plan=state.get("plan"),
        search_seconds=round(state.get("search_seconds", 0.0), 2),
        baseline=state["baseline_accuracy"],
        final=final,
        steps=opt.generation,
        adapter_dir=adapter_dir,
        sft_adapter_dir=str(Path(sft_dir).resolve()),  # absolute: the run may start elsewhere
        selected=cfg.evaluation.select,
        scale_baseline=state.get("scale_baseline"),
        scale_baseline_ran="scale_baseline" in state,  # off by default for real models
        exported=exported,
        **watch.summary(),  # stop_reason, signal_median, val_size
        dim=adapter.dim,
        test_size=state["test_size"],
        drift=report,
        **({"tools": tool_use} if tool_use else {}),
        **memory_metrics(state["model_bytes"]),
    )
    if summary["scale_baseline"] and "heldout_accuracy" in summary["scale_baseline"]:
        scale = summary["scale_baseline"]
        h.say(
            f"no-search baseline (SFT adapter x{scale['factor']:g}, chosen on training "
            f"prompts): held-out {scale['heldout_accuracy']:.3f}"
        )
    return h.finish(summary)
