"""ESSA: evolution strategies over the singular values of an SFT LoRA adapter.

The loop (Korotyshova et al., ESSA v3, Alg. 1): ask the population; evaluate every candidate on
the generation's shared prompt mini-batch in one batched pass; fitness = mean reward; tell;
log and checkpoint. Held-out accuracy of the distribution mean is measured every
``evaluation.every`` generations and never feeds back into training. What a run does around
the loop (run directory, signals, budget, progress, summary) is essa/harness/; the loop's
parts are essa/es: the plan (budget.py), the settings as planned (settings.py), the fresh
run's baselines (baselines.py), one generation (loop.py), the held-out and validation passes
(checks.py) and what they decide (watch.py).

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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from essa.config import Config
from essa.data.task import Task, render_splits
from essa.dist import Comm
from essa.es import checkpoint
from essa.es.baselines import baseline_record, fresh_state, open_watch, searched_start
from essa.es.budget import Budget
from essa.es.checks import Checks, val_prompts
from essa.es.loop import Search, shown
from essa.es.optimizer import check_searchable, search_optimizer, start_note, start_vector
from essa.es.settings import RunSettings, apply_plan
from essa.es.watch import Watch
from essa.harness import Harness
from essa.protocols import Optimizer
from essa.rewards.base import Reward

if TYPE_CHECKING:
    from essa.adapters.svd import SVDAdapter
    from essa.es.drift_budget import DriftBudget


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

    h, task = setup.open_run(
        cfg, run_dir, resume=resume, console=console, comm=comm, gradient=False
    )
    reward = _reward(cfg)
    with h:  # the trackers close whatever happens
        # cfg from here on: generation.max_new_tokens resolved (auto: from the task's references)
        cfg, model, tokenizer, base_bytes, lengths = setup.open_model(cfg, h, task)
        train_prompts, test_prompts = render_splits(task, cfg.data, tokenizer)
        # The plan (a budgeted run, essa.es.budget); SFT or load the adapter; its SVD.
        inputs = setup.plan_inputs(cfg)
        budget = Budget.start(inputs, h, resume, lengths, model, tokenizer, task, train_prompts)
        limit = budget.sft_limit(cfg.data, tokenizer, task)
        peft_model, sft_dir = setup.adapter_on_every_rank(cfg, model, tokenizer, task, h, limit)
        adapter = svd_adapter(peft_model, cfg.adapter.alpha)
        check_searchable(cfg.optimizer, adapter, sft_dir, given=bool(cfg.adapter.path))
        base = None if cfg.backend == "vllm" else peft_model.unload()  # vLLM loads its own
        del model, peft_model
        checks = _checks(cfg, h, task, base, tokenizer, adapter, reward, budget, test_prompts)
        drift = _drift_budget(cfg, h, base, tokenizer, adapter)  # None: off
        # The start: a resumed run's from its checkpoint, a fresh run's after its baselines;
        # the search's settings as planned and checked, fixed from here on.
        resumed, state = _start(cfg, checks, resume, adapter, train_prompts, reward, base_bytes)
        settings = RunSettings.planned(inputs, cfg.reward, budget.adopt(h, state), h.say, state)
        watch = open_watch(
            settings.run, settings.optimizer, settings.reward, h, checks.validate, adapter, state
        )
        search = _search(
            cfg, settings, resumed, state, checks, adapter, reward, train_prompts, tokenizer, drift
        )
        h.say(_opening(settings, adapter.dim, h.metric_name, state))
        # The loop: ask, evaluate, tell; check the mean on validation; checkpoint.
        for step in () if watch.stopped else h.steps(search.opt.generation, show=shown):
            g = step.index
            record = search.generation(g, step.progress)
            if g == 0:  # the prompts per generation, re-sized on the search's own rows
                search.resize_prompts(h, budget, record["seconds"])
            watch.signal(record.get("signal"))
            stop = checks.after_generation(g, settings.evaluation.every, watch, search.opt, record)
            state["elapsed"] = h.elapsed
            step.finish(record, lambda: checkpoint.save(run_dir, search.opt, state), stop)
        return _finish(cfg, checks, watch, search, adapter, sft_dir, base_bytes)


def _reward(cfg: Config) -> Reward:
    """The training reward, with what ESSA can feed it; a vote size no vote reaches is refused."""
    from essa.rewards.loading import check_vote_size, es_reward_inputs, load_reward

    inputs = es_reward_inputs(cfg.reward, cfg.generation, cfg.backend)
    reward = load_reward(cfg.reward, recipe="ESSA", **inputs)
    check_vote_size(cfg.generation, cfg.optimizer.population_size, reward)
    return reward


def _checks(
    cfg: Config,
    h: Harness,
    task: Task,
    model: Any,
    tokenizer: Any,
    adapter: SVDAdapter,
    reward: Reward,
    budget: Budget,
    test_prompts: list[str],
) -> Checks:
    """The population evaluator over ``adapter`` (on ``model``, the bare base model; None
    under vLLM) and the run's passes over its held-out splits."""
    from essa import setup
    from essa.backends import population_evaluator
    from essa.drift.offtask import ContinuationCache
    from essa.drift.report import adapter_pass_figures, adapter_report, adapter_warm
    from essa.es.kl_promise import kl_promise
    from essa.rewards.logprob import COMPLETION_LOGPROBS

    settings = setup.evaluator_settings(cfg)
    evaluator = population_evaluator(settings, model, tokenizer, adapter, h.comm.world_size)
    evaluator.record_logprobs = COMPLETION_LOGPROBS in reward.needs  # type: ignore[attr-defined]
    evaluator.reference_margin = cfg.reward.reference_signal == "margin"  # type: ignore[attr-defined]
    val = val_prompts(task, cfg.data, tokenizer)
    drift, cache = setup.drift_settings(cfg), ContinuationCache()  # one cache per run
    d = cfg.optimizer.drift_budget
    promise = kl_promise(
        d.kl_budget, drift, cache, model, tokenizer, adapter, h.comm, ratio=d.kl_budget_sft
    )
    pass_drift = functools.partial(adapter_pass_figures, drift, cache, model, tokenizer, adapter)
    report = functools.partial(
        adapter_report, drift, cache, h, model, tokenizer, adapter, task.test
    )
    warm = functools.partial(adapter_warm, drift, cache, h, model, tokenizer, adapter, task.test)
    return Checks(h, evaluator, task, test_prompts, val, budget, pass_drift, report, promise, warm)


def _drift_budget(
    cfg: Config, h: Harness, model: Any, tokenizer: Any, adapter: SVDAdapter
) -> DriftBudget | None:
    """The search's drift budget, announced in one line; None: optimizer.drift_budget is off."""
    from essa.es.drift_budget import drift_budget

    d, mb = cfg.optimizer.drift_budget, cfg.evaluation.micro_batch_size
    search_drift = drift_budget(d, cfg.data, mb, model, tokenizer, adapter)
    if search_drift is not None:
        h.say(search_drift.describe())
    return search_drift


def _start(
    cfg: Config,
    checks: Checks,
    resume: bool,
    adapter: SVDAdapter,
    train_prompts: list[str],
    reward: Reward,
    base_bytes: int,
) -> tuple[Optimizer | None, dict[str, Any]]:
    """A resumed run's optimizer (its plan's population) and state from its checkpoint; a fresh
    run's state after its baselines (metrics.jsonl's first line), its optimizer still to build."""
    from essa import setup
    from essa.backends.memory import memory_metrics

    h, budget = checks.h, checks.budget
    planned, _ = apply_plan(cfg.optimizer, cfg.data, budget.adopt(h, None))

    def build(saved: dict[str, Any]) -> Optimizer:  # at the start the saved search took
        return search_optimizer(planned, cfg.run.seed, adapter, searched_start(saved))

    opt, loaded = checkpoint.load(h.run_dir, build) if resume else (None, None)
    state = h.restore(loaded, done=opt.generation if opt is not None else 0)
    if state is None:
        inputs, tools = setup.plan_inputs(cfg), cfg.tools.python
        state = fresh_state(inputs, cfg.reward, tools, checks, adapter, train_prompts, reward)
        h.log(baseline_record(state, adapter.dim, memory_metrics(base_bytes)))
    return opt, state


def _search(
    cfg: Config,
    settings: RunSettings,
    resumed: Optimizer | None,
    state: dict[str, Any],
    checks: Checks,
    adapter: SVDAdapter,
    reward: Reward,
    train_prompts: list[str],
    tokenizer: Any,
    drift: DriftBudget | None,
) -> Search:
    """The search: its optimizer (``resumed``, or a fresh run's at its start as validated,
    essa.es.watch), the informative prompts' history and the tie-breaker's references."""
    from essa.data.selection import informative_prompts
    from essa.es.references import search_references

    seed, train = settings.run.seed, checks.task.train
    opt = resumed
    if opt is None:
        opt = search_optimizer(settings.optimizer, seed, adapter, searched_start(state))
    rows, history = settings.rows_per_prompt, state.get("informative")
    informative = informative_prompts(settings.data, seed, rows, tokenizer, history)
    references = search_references(cfg.tools.python, settings.reward, train)
    return Search(
        settings, opt, checks.evaluator, reward, train, train_prompts, checks.h.comm, state,
        informative, references, drift,
    )  # fmt: skip


def _opening(settings: RunSettings, dim: int, metric: str, state: dict[str, Any]) -> str:
    """The search's opening line: its size and the SFT adapter's held-out score."""
    held_out = f"held-out {metric} baseline {state['baseline_accuracy']:.3f}"
    if (state.get("watch") or {}).get("stop"):  # the pre-flight kept the start
        return f"ESSA: no search (the pre-flight kept the start), {held_out}"
    return (
        f"ESSA: D={dim} singular-value offsets, population "
        f"{settings.optimizer.population_size}, {settings.data.batch_size} prompts/generation, "
        f"{held_out}" + start_note(settings.optimizer, state)
    )


def _finish(
    cfg: Config,
    checks: Checks,
    watch: Watch,
    search: Search,
    adapter: SVDAdapter,
    sft_dir: str,
    base_bytes: int,
) -> dict[str, Any]:
    """Evaluate the exported point on the held-out split (every rank, sharded); rank 0 alone
    measures its drift (essa/drift/), exports it and writes the summary (the others return
    ``{}``)."""
    from essa.backends.memory import memory_metrics

    h, opt, state = checks.h, search.opt, search.state
    best = state["best_vector"]
    start = start_vector(search.settings.optimizer, adapter, searched_start(state))
    select, sft_scores = search.settings.evaluation.select, state.get("baseline_scores")
    exported = checks.export(watch, opt, select, best, start, sft_scores)
    if not h.is_root:
        return {}
    if "generations" in h.reporter.planned:  # the loop's phase also holds its held-out checks
        h.reporter.actual["generations"] = state.get("search_seconds", 0.0)
    report = checks.drift_report(exported.vector)
    adapter_dir = h.run_dir / "adapter"
    with h.phase("export"):
        name = cfg.model.name_or_path
        adapter.export_peft(exported.vector, adapter_dir, base_model_name_or_path=name)
    summary = h.summary(
        max_new_tokens=search.settings.generation.new_tokens,
        plan=state.get("plan"),
        search_seconds=round(state.get("search_seconds", 0.0), 2),
        baseline=state["baseline_accuracy"],
        final=exported.heldout,
        steps=opt.generation,
        adapter_dir=adapter_dir,
        sft_adapter_dir=str(Path(sft_dir).resolve()),  # absolute: the run may start elsewhere
        selected=search.settings.evaluation.select,
        scale_baseline=state.get("scale_baseline"),
        scale_baseline_ran="scale_baseline" in state,  # off by default for real models
        exported=exported.account,
        **watch.summary(),  # stop_reason, signal_median, val_size
        dim=adapter.dim,
        test_size=len(checks.task.test),
        drift=report,
        **({"tools": exported.tools} if exported.tools else {}),
        **memory_metrics(base_bytes),
    )
    if summary["scale_baseline"] and "heldout_accuracy" in summary["scale_baseline"]:
        scale = summary["scale_baseline"]
        h.say(
            f"no-search baseline (SFT adapter x{scale['factor']:g}, chosen on training "
            f"prompts): held-out {scale['heldout_accuracy']:.3f}"
        )
    return h.finish(summary)
