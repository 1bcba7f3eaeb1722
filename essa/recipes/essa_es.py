"""ESSA: evolution strategies over the singular values of an SFT LoRA adapter.

The loop (Korotyshova et al., ESSA v3, Alg. 1): ask the population; evaluate every candidate on
the generation's shared prompt mini-batch in one batched pass; fitness = mean reward; tell;
log and checkpoint. Held-out accuracy of the distribution mean is measured every
``evaluation.every`` generations and never feeds back into training.

Deviations from the paper (see ../shared/spec/essa.md §4):
* one common mini-batch per generation (common random numbers) instead of one per candidate;
* greedy decoding by default;
* CMA-ES steps are relative: coordinate i moves in units of its SFT singular value;
* the exported solution is the distribution mean by default (``evaluation.select``), because the
  best candidate's mini-batch score is a lucky draw;
* SFT time is included in the wall time we report (the paper excludes it).
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from essa.config import Config, dump_config
from essa.dist import Comm
from essa.errors import UserError
from essa.rundir import (
    MetricsLog,
    atomic_write_json,
    atomic_write_text,
    recover,
    stop_on_storage_error,
)
from essa.types import AdapterVector, Example


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
    from essa.adapters import SVDAdapter
    from essa.backends.evaluator import PopulationEvaluator
    from essa.backends.hf import load_model
    from essa.backends.memory import memory_metrics, model_bytes
    from essa.dist import any_rank, get_comm, place_rank
    from essa.recipes.common import (
        load_task,
        render_prompts,
        seed_everything,
    )

    wall_start = time.perf_counter()
    comm = get_comm() if comm is None else comm
    is_root = comm.rank == 0
    console = console if is_root else None  # one progress bar, one set of messages
    if is_root and not resume:  # first, so that a kill at any later moment can be resumed
        atomic_write_text(run_dir / "config.yaml", dump_config(cfg))
    seed_everything(cfg.run.seed)
    task = load_task(cfg.data, cfg.run.seed)
    reward = _load_reward(cfg)
    if cfg.backend == "vllm":
        from essa.backends.vllm import require_vllm

        require_vllm()  # before the model loads and SFT runs
    model, tokenizer = load_model(place_rank(cfg.model, comm))
    base_bytes = model_bytes(model)  # the base weights as stored (quantised ones packed)
    peft_model, sft_dir = _adapter_on_every_rank(
        cfg, model, tokenizer, task, run_dir, console, comm
    )
    try:
        adapter = SVDAdapter.from_peft_model(peft_model, alpha=cfg.adapter.alpha)
    except ValueError as err:  # e.g. alpha * r selects no singular value of a given adapter
        raise UserError(f"adapter: {err}") from None
    if cfg.backend == "vllm":
        del model, peft_model  # the engine loads its own copy of the base: free this one first
        evaluator = _vllm_evaluator(cfg, tokenizer, adapter, comm)
    else:  # the base, with candidates applied by the evaluator
        evaluator = PopulationEvaluator(
            peft_model.unload(), tokenizer, adapter, cfg.generation, cfg.evaluation
        )
    train_prompts = render_prompts(task.train, cfg.data.template, tokenizer)
    test_prompts = render_prompts(task.test, cfg.data.template, tokenizer)

    def heldout(vector: AdapterVector) -> float:
        if not is_root:
            return float("nan")  # rank 0 alone reports it; it never feeds back into training
        return _accuracy(evaluator, vector, task.test, test_prompts)

    opt = _make_optimizer(cfg, adapter)
    metrics = MetricsLog(run_dir / "metrics.jsonl", enabled=is_root)
    state = _load_checkpoint(run_dir, opt) if resume else None
    if state is None:
        metrics.truncate_after(-2)
        state = _initial_state(cfg, evaluator, adapter, task, train_prompts, reward, heldout)
        metrics.write(
            {
                "generation": -1,
                "event": "baseline",
                "dim": adapter.dim,
                "heldout_accuracy": state["baseline_accuracy"],
                **memory_metrics(base_bytes),
            }
        )
    else:
        metrics.truncate_after(opt.generation - 1)
    _say(
        console,
        f"ESSA: D={adapter.dim} singular-value offsets, population "
        f"{cfg.optimizer.population_size}, {cfg.data.batch_size} prompts/generation, "
        f"held-out baseline {state['baseline_accuracy']:.3f}",
    )
    elapsed_before = state["elapsed"]
    with _progress(cfg, console, opt.generation) as advance, _Interrupt() as interrupt:
        while opt.generation < cfg.run.generations:
            g = opt.generation
            record, population, fitness = _generation(
                cfg, g, opt, evaluator, task.train, train_prompts, reward, comm
            )
            _track_best(state, population, fitness)
            if cfg.evaluation.every and (g + 1) % cfg.evaluation.every == 0:
                record["heldout_accuracy"] = heldout(opt.mean)
            state["elapsed"] = elapsed_before + time.perf_counter() - wall_start
            _persist(run_dir, g, record, metrics, opt, state, is_root)
            advance(record)
            if interrupt.signum is not None:
                _say(
                    console,
                    f"interrupted by signal {interrupt.signum}: checkpoint at generation "
                    f"{opt.generation} saved; continue with: essa train --resume {run_dir}",
                )
                raise SystemExit(128 + interrupt.signum)
            # Ranks time themselves differently: they must agree to stop, or some would block.
            if cfg.run.max_wall_seconds and any_rank(
                comm, state["elapsed"] > cfg.run.max_wall_seconds
            ):
                _say(console, f"stopping: run.max_wall_seconds={cfg.run.max_wall_seconds} reached")
                break
    state["test_size"] = len(task.test)
    state["model_bytes"] = base_bytes
    state["elapsed"] = elapsed_before + time.perf_counter() - wall_start
    if not is_root:
        return {}  # rank 0 alone evaluates, exports and writes the summary
    return _finish(cfg, run_dir, adapter, opt, state, heldout, sft_dir, wall_start, console)


def _generation(
    cfg: Config,
    g: int,
    opt: Any,
    evaluator: Any,
    problems: list[Example],
    prompts: list[str],
    reward: Any,
    comm: Comm,
) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """One ask / evaluate / tell on every rank: the metrics record, population (P, D), fitness (P,)."""
    from essa.dist import check_replicas

    start = time.perf_counter()
    bytes_before, tokens_before = comm.comm_bytes, evaluator.stats.new_tokens
    faults_before = _fault_counts(reward, evaluator)
    population = opt.ask()  # (P, D), identical on every rank
    fitness = _fitness(cfg, g, population, evaluator, problems, prompts, reward, comm)
    faults = _fault_delta(faults_before, _fault_counts(reward, evaluator))
    _check_generation(g, fitness, faults, reward.name)
    opt_metrics = opt.tell(population, fitness)
    check_replicas(comm, opt, g)  # every rank must now hold the same state
    tokens = evaluator.stats.new_tokens - tokens_before
    seconds = time.perf_counter() - start
    record = _generation_record(g, fitness, opt_metrics, seconds, tokens, evaluator)
    record.update(world_size=comm.world_size, comm_bytes=comm.comm_bytes - bytes_before)
    record.update(faults)
    return record, population, fitness


def _persist(
    run_dir: Path,
    g: int,
    record: dict[str, Any],
    metrics: MetricsLog,
    opt: Any,
    state: dict[str, Any],
    is_root: bool,
) -> None:
    """Append generation g's record, then checkpoint; a storage fault stops with the way on."""
    # Metrics first: a kill between the two writes redoes generation g on resume, which drops
    # and rewrites its record; the other order could lose the record.
    with stop_on_storage_error(run_dir, g, "generations"):
        metrics.write(record)
        if is_root:
            _save_checkpoint(run_dir, opt, state)


def _vllm_evaluator(cfg: Config, tokenizer: Any, adapter: Any, comm: Comm) -> Any:
    """backend: vllm: one engine per rank, one LoRA slot per candidate of this rank's shard."""
    import gc

    import torch

    from essa.backends.hf import resolve_model_path
    from essa.backends.vllm import VLLMEvaluator

    gc.collect()  # the HF copy of the base (SFT, SVD) must be gone before vLLM sizes its memory
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    slots = -(-cfg.optimizer.population_size // comm.world_size)  # the largest shard
    path = resolve_model_path(cfg.model.name_or_path)
    return VLLMEvaluator(cfg, adapter, tokenizer, path, slots=slots)


def _load_reward(cfg: Config) -> Any:
    from essa.rewards import get_reward
    from essa.rewards.deadline import with_deadline

    try:
        reward = get_reward(cfg.reward.name, **cfg.reward.params)
    except (ValueError, ImportError) as err:
        raise UserError(f"reward.name: {err}") from None
    if ":" in cfg.reward.name and cfg.reward.timeout_seconds is not None:
        reward = with_deadline(reward, cfg.reward.timeout_seconds)  # custom code may hang
    if cfg.backend == "vllm" and not reward.is_group and reward.needs == {"completion_logprobs"}:
        return reward  # the vLLM backend returns the sampled tokens' log-probs (_scores)
    if reward.is_group or reward.needs:
        # Greedy ESSA yields one completion per (candidate, prompt), and ranks hold only their
        # own candidates' completions, so there is no group to vote in and no log-prob hook yet.
        needs = "a group of completions per prompt" if reward.is_group else sorted(reward.needs)
        raise UserError(
            f"reward.name: {cfg.reward.name} needs {needs}, "
            "which the ESSA recipe does not provide yet"
        )
    return reward


def _initial_state(
    cfg: Config,
    evaluator: Any,
    adapter: Any,
    task: Any,
    train_prompts: list[str],
    reward: Any,
    heldout: Any,
) -> dict[str, Any]:
    """Fresh-run state: the SFT adapter's held-out accuracy and the no-search baseline."""
    state: dict[str, Any] = {
        "baseline_accuracy": heldout(np.zeros(adapter.dim)),
        "best_fitness": None,
        "best_vector": None,
        "elapsed": 0.0,
    }
    if cfg.evaluation.use_scale_baseline:
        state["scale_baseline"] = _scale_baseline(
            evaluator, adapter, task.train, train_prompts, reward, cfg.run.seed, heldout
        )
    return state


def _fitness(
    cfg: Config,
    g: int,
    population: np.ndarray,
    evaluator: Any,
    train: list[Example],
    train_prompts: list[str],
    reward: Any,
    comm: Comm,
) -> np.ndarray:
    """Evaluate this rank's shard on generation g's shared prompts; all-gather the fitness."""
    from essa.dist import shard
    from essa.rewards import fitness_from_rewards

    idx = _minibatch(len(train), cfg.data.batch_size, cfg.run.seed, g)
    prompts = [train_prompts[i] for i in idx]
    answers = [train[i].answer for i in idx]
    mine = shard(len(population), comm.rank, comm.world_size)
    texts = evaluator.completions(population[mine], prompts, seed=cfg.run.seed * 100_003 + g)
    scores = _scores(reward, evaluator, texts, answers, prompts)
    local = np.array([fitness_from_rewards(s) for s in scores])
    local[evaluator.nonfinite] = np.nan  # NaN/inf logits: graded text would be garbage
    local[~np.isfinite(local)] = np.nan  # +-inf fitness is a failed evaluation too
    return comm.allgather_fitness(local)  # (P,) float64: the only data crossing ranks


def _scores(
    reward: Any, evaluator: Any, texts: list[list[str]], answers: list[Any], prompts: list[str]
) -> list[list[float | None]]:
    """Per candidate, the reward of each completion; log-prob rewards take the backend's."""
    if not reward.needs:
        return [reward(t, answers, prompts) for t in texts]
    return [
        reward.score_with_logprobs(t, answers, prompts, logprobs)
        for t, logprobs in zip(texts, evaluator.last_logprobs, strict=True)
    ]


def _fault_counts(reward: Any, evaluator: Any) -> dict[str, int]:
    """Running fault counters of this rank (reward timeouts and errors, non-finite logits)."""
    stats = reward.stats.as_dict()
    return {
        "reward_timeouts": stats["n_timeout"],
        "reward_errors": stats["n_error"],
        "nonfinite_candidates": int(evaluator.nonfinite.sum()),
    }


def _fault_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    delta = {key: after[key] - before[key] for key in ("reward_timeouts", "reward_errors")}
    delta["nonfinite_candidates"] = after["nonfinite_candidates"]  # a per-call count already
    return delta


def _check_generation(g: int, fitness: np.ndarray, faults: dict[str, int], reward: str) -> None:
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


def _adapter_on_every_rank(
    cfg: Config,
    model: Any,
    tokenizer: Any,
    task: Any,
    run_dir: Path,
    console: Any,
    comm: Comm,
) -> tuple[Any, str]:
    """Rank 0 loads or trains (and saves) the adapter; then the other ranks load the saved one.

    Loading rank 0's saved SFT adapter, rather than training it on every rank, gives every
    replica bit-identical singular values even where training is not deterministic (GPU kernels).
    """
    from essa.recipes.common import load_or_train_adapter

    if comm.rank == 0:
        loaded = load_or_train_adapter(cfg, model, tokenizer, task, run_dir, console)
    comm.barrier()
    if comm.rank != 0:
        if cfg.adapter.path is None and not (run_dir / "sft_adapter").is_dir():
            raise UserError(
                f"run.dir {run_dir}: rank {comm.rank} cannot see the SFT adapter rank 0 saved "
                "there; with ranks on several nodes run.dir must be on a shared filesystem"
            )
        loaded = load_or_train_adapter(cfg, model, tokenizer, task, run_dir, None)
    return loaded


def _make_optimizer(cfg: Config, adapter: Any) -> Any:
    """The configured optimizer over the adapter's D offsets, layerwise when configured."""
    from essa.optimizers import make_optimizer

    o = cfg.optimizer
    stds = adapter.stds() if o.use_relative_steps else None
    common = {
        "population_size": o.population_size,
        "sigma0": o.sigma0,
        "seed": cfg.run.seed,
        "stds": stds,
        **_optimizer_options(cfg),
    }
    if o.layerwise.active_layers is None:
        return make_optimizer(o.name, adapter.dim, **common)
    from essa.adapters.layerwise import layer_blocks
    from essa.optimizers.layerwise import LayerwiseES

    try:
        blocks = layer_blocks(adapter.manifest())
    except ValueError as err:
        raise UserError(f"optimizer.layerwise: {err}") from None
    if o.layerwise.active_layers > len(blocks):
        raise UserError(
            f"optimizer.layerwise.active_layers: must be in 1..{len(blocks)} (the adapter's "
            f"layers), got {o.layerwise.active_layers}"
        )
    return LayerwiseES(
        adapter.dim,
        layer_indices=blocks,
        active_layers=o.layerwise.active_layers,
        interval=o.layerwise.interval,
        base=o.name,
        use_carried_sigma=o.layerwise.use_carried_sigma,
        **common,
    )


def _optimizer_options(cfg: Config) -> dict[str, Any]:
    o = cfg.optimizer
    if o.name == "cma_es":
        return {"variant": o.variant, "sep_above_dim": o.sep_above_dim}
    return {"lr": o.lr, "step": o.step}


SCALE_FACTORS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
SCALE_PROMPTS = 256


def scale_vector(adapter: Any, factor: float) -> AdapterVector:
    """Offsets that scale every module's delta-W uniformly by ``factor`` (s_B -> factor * s_B).

    With adapter.alpha < 1 only the searched singular values scale, so this is approximate.
    """
    x = np.zeros(adapter.dim)
    for module in adapter.modules:
        x[module.slice_b] = (factor - 1.0) * np.asarray(module.s_b[: module.k])
    return x


def _scale_baseline(
    evaluator: Any,
    adapter: Any,
    train: list[Example],
    prompts: list[str],
    reward: Any,
    seed: int,
    heldout: Any,
) -> dict[str, float] | None:
    """The no-search baseline: the SFT adapter scaled by the factor best on training prompts."""
    from essa.rewards import fitness_from_rewards

    rng = np.random.default_rng(np.random.SeedSequence([seed, 3]))
    idx = rng.choice(len(train), size=min(SCALE_PROMPTS, len(train)), replace=False)
    batch = [prompts[i] for i in idx]
    answers = [train[i].answer for i in idx]
    population = np.stack([scale_vector(adapter, f) for f in SCALE_FACTORS])  # (8, D)
    texts = evaluator.completions(population, batch)
    fitness = [fitness_from_rewards(s) for s in _scores(reward, evaluator, texts, answers, batch)]
    if np.all(np.isnan(fitness)):  # the reward failed everywhere: no baseline to report
        return None
    best = int(np.nanargmax(fitness))
    return {
        "factor": SCALE_FACTORS[best],
        "train_fitness": float(fitness[best]),
        "heldout_accuracy": heldout(population[best]),
    }


def _minibatch(n: int, size: int, seed: int, generation: int) -> np.ndarray:
    """The generation's shared prompt indices: a pure function of (seed, generation)."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 2, generation]))
    return rng.choice(n, size=min(size, n), replace=False)


def _accuracy(
    evaluator: Any, vector: AdapterVector, examples: list[Example], prompts: list[str]
) -> float:
    from essa.recipes.common import accuracy

    if not examples:
        return float("nan")
    (texts,) = evaluator.completions(np.asarray(vector)[None, :], prompts)
    return accuracy(texts, examples, prompts)


def _track_best(state: dict[str, Any], population: np.ndarray, fitness: np.ndarray) -> None:
    if np.all(np.isnan(fitness)):
        return
    i = int(np.nanargmax(fitness))
    if state["best_fitness"] is None or fitness[i] > state["best_fitness"]:
        state["best_fitness"] = float(fitness[i])
        state["best_vector"] = population[i].tolist()


def _generation_record(
    g: int,
    fitness: np.ndarray,
    opt_metrics: dict[str, float],
    seconds: float,
    tokens: int,
    evaluator: Any,
) -> dict[str, Any]:
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


def _save_checkpoint(run_dir: Path, opt: Any, state: dict[str, Any]) -> None:
    from essa.faults import checkpoint_fault

    atomic_write_json(
        run_dir / "checkpoint.json",
        {"optimizer": opt.state_dict(), **state},
        before_rename=checkpoint_fault(opt.generation),  # None unless ESSA_FAULT is set (tests)
    )


def _load_checkpoint(run_dir: Path, opt: Any) -> dict[str, Any] | None:
    import json

    recover(run_dir / "checkpoint.json")
    path = run_dir / "checkpoint.json"
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        opt.load_state_dict(data.pop("optimizer"))
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
        # Atomic writes never leave a torn checkpoint; this one was edited, damaged, or was
        # written under another optimizer setting (--set on resume).
        raise UserError(
            f"{path}: cannot resume from this checkpoint ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else 'invalid'}); start a new run or "
            "restore the file"
        ) from None
    return data


def _finish(
    cfg: Config,
    run_dir: Path,
    adapter: Any,
    opt: Any,
    state: dict[str, Any],
    heldout: Any,
    sft_dir: str,
    wall_start: float,
    console: Any,
) -> dict[str, Any]:
    from essa.backends.memory import memory_metrics

    t0 = time.perf_counter()
    vector = np.asarray(opt.mean)
    if cfg.evaluation.select == "best" and state["best_vector"] is not None:
        vector = np.asarray(state["best_vector"])
    final = heldout(vector)
    adapter_dir = run_dir / "adapter"
    adapter.export_peft(vector, adapter_dir, base_model_name_or_path=cfg.model.name_or_path)
    summary = {
        "baseline_accuracy": state["baseline_accuracy"],
        "final_accuracy": final,
        "improvement": final - state["baseline_accuracy"],
        "generations": opt.generation,
        "wall_seconds": round(state["elapsed"] + time.perf_counter() - t0, 2),
        "process_wall_seconds": round(time.perf_counter() - wall_start, 2),
        "adapter_dir": str(adapter_dir.resolve()),  # absolute: the run may start elsewhere
        "sft_adapter_dir": str(Path(sft_dir).resolve()),
        "selected": cfg.evaluation.select,
        "scale_baseline": state.get("scale_baseline"),
        "scale_baseline_ran": "scale_baseline" in state,  # off by default for real models
        "dim": adapter.dim,
        "test_size": state["test_size"],
        **memory_metrics(state["model_bytes"]),
    }
    atomic_write_json(run_dir / "summary.json", summary)
    if summary["scale_baseline"]:
        scale = summary["scale_baseline"]
        _say(
            console,
            f"no-search baseline (SFT adapter x{scale['factor']:g}, chosen on training "
            f"prompts): held-out {scale['heldout_accuracy']:.3f}",
        )
    _say(
        console,
        f"held-out accuracy {summary['baseline_accuracy']:.3f} -> {final:.3f} "
        f"({summary['improvement']:+.3f}); adapter: {adapter_dir}",
    )
    return summary


def _say(console: Any, text: str) -> None:
    if console is not None:
        console.print(text, soft_wrap=True)  # no hard wraps: paths and commands stay copyable


class _progress:
    """A rich progress bar over generations (a no-op when show_progress is off)."""

    def __init__(self, cfg: Config, console: Any, start: int) -> None:
        self.total = cfg.run.generations
        self.start = start
        self.enabled = cfg.run.show_progress and console is not None
        self.console = console
        self.bar: Any = None

    def __enter__(self) -> Any:
        if self.enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.bar = Progress(
                TextColumn("[bold]ESSA"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=self.console,
                transient=False,
            )
            self.bar.start()
            self.task = self.bar.add_task("", total=self.total, completed=self.start)
        return self.advance

    def advance(self, record: dict[str, Any]) -> None:
        if self.bar is None:
            return
        text = f"fitness mean {_fmt(record['mean_fitness'])} best {_fmt(record['best_fitness'])}"
        if "heldout_accuracy" in record:
            text += f" held-out {record['heldout_accuracy']:.3f}"
            self.bar.console.print(f"generation {record['generation'] + 1}: {text}")
        self.bar.update(self.task, advance=1, description=text)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


class _Interrupt:
    """SIGINT/SIGTERM finish the current generation, checkpoint it, then exit 130/143.

    A second signal acts at once (KeyboardInterrupt / default termination); the last
    checkpoint on disk is then still complete, because every write is atomic.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.signum = signum

    def __enter__(self) -> _Interrupt:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
