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
from essa.rundir import MetricsLog, atomic_write_json, recover
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
    from essa.dist import any_rank, check_replicas, get_comm, place_rank
    from essa.optimizers import make_optimizer
    from essa.recipes.common import (
        load_task,
        render_prompts,
        seed_everything,
    )

    wall_start = time.perf_counter()
    comm = get_comm() if comm is None else comm
    is_root = comm.rank == 0
    console = console if is_root else None  # one progress bar, one set of messages
    seed_everything(cfg.run.seed)
    task = load_task(cfg.data, cfg.run.seed)
    reward = _load_reward(cfg)
    model, tokenizer = load_model(place_rank(cfg.model, comm))
    base_bytes = model_bytes(model)  # the base weights as stored (quantised ones packed)
    if is_root and not resume:
        (run_dir / "config.yaml").write_text(dump_config(cfg))
    peft_model, sft_dir = _adapter_on_every_rank(
        cfg, model, tokenizer, task, run_dir, console, comm
    )
    try:
        adapter = SVDAdapter.from_peft_model(peft_model, alpha=cfg.adapter.alpha)
    except ValueError as err:  # e.g. alpha * r selects no singular value of a given adapter
        raise UserError(f"adapter: {err}") from None
    model = peft_model.unload()  # the base; candidates are applied by the evaluator
    evaluator = PopulationEvaluator(model, tokenizer, adapter, cfg.generation, cfg.evaluation)
    train_prompts = render_prompts(task.train, cfg.data.template, tokenizer)
    test_prompts = render_prompts(task.test, cfg.data.template, tokenizer)

    def heldout(vector: AdapterVector) -> float:
        if not is_root:
            return float("nan")  # rank 0 alone reports it; it never feeds back into training
        return _accuracy(evaluator, vector, task.test, test_prompts)

    stds = adapter.stds() if cfg.optimizer.use_relative_steps else None
    opt = make_optimizer(
        cfg.optimizer.name,
        adapter.dim,
        population_size=cfg.optimizer.population_size,
        sigma0=cfg.optimizer.sigma0,
        seed=cfg.run.seed,
        stds=stds,
        **_optimizer_options(cfg),
    )
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
            gen_start = time.perf_counter()
            bytes_before = comm.comm_bytes
            tokens_before = evaluator.stats.new_tokens
            population = opt.ask()  # (P, D), identical on every rank
            fitness = _fitness(
                cfg, g, population, evaluator, task.train, train_prompts, reward, comm
            )
            opt_metrics = opt.tell(population, fitness)
            check_replicas(comm, opt, g)  # every rank must now hold the same state
            _track_best(state, population, fitness)
            seconds = time.perf_counter() - gen_start
            record = _generation_record(
                g,
                fitness,
                opt_metrics,
                seconds,
                evaluator.stats.new_tokens - tokens_before,
                evaluator,
            )
            record.update(world_size=comm.world_size, comm_bytes=comm.comm_bytes - bytes_before)
            if cfg.evaluation.every and (g + 1) % cfg.evaluation.every == 0:
                record["heldout_accuracy"] = heldout(opt.mean)
            state["elapsed"] = elapsed_before + time.perf_counter() - wall_start
            # Metrics first: a kill between the two writes redoes generation g on resume,
            # which drops and rewrites its record; the other order could lose the record.
            metrics.write(record)
            if is_root:
                _save_checkpoint(run_dir, opt, state)
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


def _load_reward(cfg: Config) -> Any:
    from essa.rewards import get_reward

    try:
        reward = get_reward(cfg.reward.name, **cfg.reward.params)
    except (ValueError, ImportError) as err:
        raise UserError(f"reward.name: {err}") from None
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
    local = np.array([fitness_from_rewards(reward(t, answers, prompts)) for t in texts])
    return comm.allgather_fitness(local)  # (P,) float64: the only data crossing ranks


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
) -> dict[str, float]:
    """The no-search baseline: the SFT adapter scaled by the factor best on training prompts."""
    from essa.rewards import fitness_from_rewards

    rng = np.random.default_rng(np.random.SeedSequence([seed, 3]))
    idx = rng.choice(len(train), size=min(SCALE_PROMPTS, len(train)), replace=False)
    batch = [prompts[i] for i in idx]
    answers = [train[i].answer for i in idx]
    population = np.stack([scale_vector(adapter, f) for f in SCALE_FACTORS])  # (8, D)
    texts = evaluator.completions(population, batch)
    fitness = [fitness_from_rewards(reward(t, answers, batch)) for t in texts]
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
    atomic_write_json(run_dir / "checkpoint.json", {"optimizer": opt.state_dict(), **state})


def _load_checkpoint(run_dir: Path, opt: Any) -> dict[str, Any] | None:
    import json

    recover(run_dir / "checkpoint.json")
    path = run_dir / "checkpoint.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    opt.load_state_dict(data.pop("optimizer"))
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
        "adapter_dir": str(adapter_dir),
        "sft_adapter_dir": sft_dir,
        "selected": cfg.evaluation.select,
        "scale_baseline": state.get("scale_baseline"),
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
