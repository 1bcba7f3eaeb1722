"""The Python API: load a config, train, evaluate. The ``essa`` command runs these same calls
after it has parsed its arguments (essa/cli.py), so a script and the command share one path.

Importing this module is cheap: torch, transformers and MPI are imported inside the calls.
User errors raise :class:`essa.errors.UserError` or :class:`essa.config.ConfigError`
(:class:`essa.data.DataError` for bad data) with a one-line message, the line the command
prints after ``error:``; messages name the command's options (``--adapter``) and config keys.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from essa.config import Config
    from essa.dist import Comm

PathLike: TypeAlias = "str | os.PathLike[str]"
ConfigLike: TypeAlias = "Config | PathLike | None"  # a Config, a YAML file, or None: the demo


def say(line: str) -> None:
    """A note or warning on stderr, as the command prints it."""
    print(line, file=sys.stderr, flush=True)


def load_config(path: PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load and check a YAML config (``None``: the embedded demo config).

    ``overrides`` are ``--set`` items, ``"KEY=VALUE"`` with a YAML value
    (``"optimizer.sigma0=0.2"``). An unknown key, a wrong type or a bad value raises
    :class:`essa.config.ConfigError` naming the file, line and key
    (``configs/demo.yaml:7: optimizer.sigma: unknown key (known: ...)``).
    """
    from essa.config import load_config as load

    return load(None if path is None else Path(path), overrides)


def resolve_config(config: ConfigLike, overrides: Sequence[str] = ()) -> Config:
    """``config`` as a checked :class:`~essa.config.Config`: a file or None is loaded with
    ``overrides``; a Config is checked as a file would be (its own errors, no file:line)."""
    from essa.config import Config, ConfigError, check_values

    if not isinstance(config, Config):
        return load_config(config, overrides)
    if overrides:
        raise ConfigError(
            "overrides: apply to a config file (or None, the demo); change a Config object "
            "with dataclasses.replace"
        )
    check_values(config)
    return config


def check_before_load(cfg: Config, config: ConfigLike, overrides: Sequence[str]) -> None:
    """What needs the tokenizer (data.template), checked before any model loads or anything is
    written; the error names where the key was set, as config errors do."""
    from essa.config import Config, key_location
    from essa.data.task import check_prompt_template
    from essa.errors import UserError

    try:
        check_prompt_template(cfg.data, cfg.model)
        if cfg.tools.python.max_tool_calls:
            from essa.tools.sandbox import check_sandbox

            check_sandbox(cfg.tools.python)  # one snippet: bwrap works here, or one line why
    except UserError as err:
        if isinstance(config, Config):  # no file to point at: the key leads the message
            raise
        key = str(err).split(":", 1)[0]
        path = None if config is None else Path(config)
        raise UserError(f"{key_location(path, overrides, key)}: {err}") from None


# ---------------------------------------------------------------------------------------------
# Training


@dataclass(frozen=True)
class TrainedRun:
    """What :func:`train_run` ran: the config, its run directory and its summary."""

    config: Config
    run_dir: Path
    summary: dict[str, Any]  # summary.json's content (rank 0; see the recipe for other ranks)
    unit: str  # what run.generations counted: "generations" (ESSA) or "steps"


def train(
    config: ConfigLike = None,
    *,
    overrides: Sequence[str] = (),
    run_dir: PathLike | None = None,
    resume: bool = False,
    overwrite: bool = False,
    console: Any = None,
) -> dict[str, Any]:
    """Train an adapter with the config's ``algorithm`` (ESSA by default); return the summary.

    ``config``: a :class:`~essa.config.Config`, a YAML file or None (the embedded demo);
    ``overrides``: ``"KEY=VALUE"`` items applied to a file's config. ``run_dir`` defaults to
    ``run.dir``; an existing one is refused unless ``overwrite`` (replace it) or ``resume``
    (continue from its checkpoint with the config saved there, ``overrides`` on top).
    ``console``: a ``rich.console.Console`` for progress and messages (None: silent; the run
    directory records everything). SFT runs first when the config names no adapter.

    The run directory holds config.yaml (written before any work), metrics.jsonl, the exported
    adapter and summary.json (docs/usage.md); the returned dict is summary.json's content:
    baseline_accuracy, final_accuracy, heldout_metric, generations, wall_seconds, adapter_dir,
    .... Under mpiexec every rank calls this (rank 0 alone writes).
    """
    run = train_run(
        config,
        overrides=overrides,
        run_dir=run_dir,
        resume=resume,
        overwrite=overwrite,
        console=console,
    )
    return run.summary


def train_run(
    config: ConfigLike = None,
    *,
    overrides: Sequence[str] = (),
    run_dir: PathLike | None = None,
    resume: bool = False,
    overwrite: bool = False,
    console: Any = None,
    comm: Comm | None = None,
) -> TrainedRun:
    """:func:`train`, returning the config and run directory with the summary (what the
    command's closing lines print); ``comm``: the communicator (None: this process's)."""
    from essa.config import dump_config, tiny_sft_warning
    from essa.dist import get_comm
    from essa.harness import progress_interval
    from essa.recipes import recipe
    from essa.rundir import atomic_write_text, prepare_run_dir
    from essa.tracking import check_trackers

    comm = get_comm() if comm is None else comm
    source, cfg, directory = _run_config(config, overrides, run_dir, resume, comm.rank)
    check_trackers(cfg.run.report_to)  # a missing library fails before any model loads
    progress_interval()  # a bad ESSA_PROGRESS_SECONDS fails before the run directory is made
    if comm.rank == 0:  # the others wait: rank 0 alone creates, checks or replaces it
        check_before_load(cfg, source, overrides)  # also: a missing model is its error line alone
        warning = tiny_sft_warning(cfg)
        if warning is not None and not resume:
            say(warning)
        prepare_run_dir(directory, resume=resume, overwrite=overwrite)
        if not resume:  # at once, so that a kill at any later moment can be resumed
            atomic_write_text(directory / "config.yaml", dump_config(cfg))
    comm.barrier()
    entry = recipe(cfg.algorithm)
    summary = entry.load()(cfg, directory, resume=resume, console=console, comm=comm)
    return TrainedRun(cfg, directory, summary, entry.unit)


def _run_config(
    config: ConfigLike, overrides: Sequence[str], run_dir: PathLike | None, resume: bool, rank: int
) -> tuple[ConfigLike, Config, Path]:
    """(where the config came from, the config, the run directory). A resumed run takes the
    config saved in its directory (``overrides`` on top); ``config`` then only names the
    directory, through its run.dir, when ``run_dir`` is not given."""
    if not resume:
        cfg = resolve_config(config, overrides)
        return config, cfg, Path(run_dir) if run_dir is not None else Path(cfg.run.dir)
    if run_dir is None:
        directory = Path(resolve_config(config).run.dir)
    else:
        directory = Path(run_dir)
        if config is not None and rank == 0:
            given = config if isinstance(config, str | os.PathLike) else "the given config"
            say(f"note: resuming with the config saved in {directory}; {given} is not read")
    saved = directory / "config.yaml"
    return saved, load_config(saved, overrides), directory


# ---------------------------------------------------------------------------------------------
# Evaluation


def evaluate(
    config: ConfigLike = None,
    *,
    overrides: Sequence[str] = (),
    adapter: PathLike | None = None,
    samples: int = 1,
    output: PathLike | None = None,
    sft_adapter: PathLike | None = None,
) -> dict[str, Any]:
    """Score the model, or ``adapter`` on it, on the config's held-out split (``essa eval``).

    The score is ``evaluation.metric``: ``pass@1`` (full credit) and ``mean_score`` (partial
    credit included, as training reports it); with ``samples`` K > 1 (needs
    ``generation.temperature`` > 0) also avg@K, pass@K and maj@K. ``drift``: off-task KL to the
    base (and to ``sft_adapter``, the SFT adapter ``adapter`` started from), update size,
    retention and pass@K (docs/drift.md). ``output``: also write the result there as JSON and
    one record per completion to ``FILE.items.jsonl`` (both checked before any work).

    Returns the result: the metrics, ``metric``, ``n``, ``samples``, ``adapter``, ``model``,
    ``drift`` (and ``items``, the records' path, with ``output``).
    """
    from essa.backends.models import load_model
    from essa.data.task import load_task
    from essa.errors import UserError
    from essa.evaluation import check_heldout_answers, heldout_metric
    from essa.setup import resolve_lengths, seed_everything

    cfg = resolve_config(config, overrides)
    adapter_dir = None if adapter is None else Path(adapter)
    sft_dir = None if sft_adapter is None else Path(sft_adapter)
    out = None if output is None else Path(output)
    if samples < 1 or (samples > 1 and cfg.generation.temperature <= 0):
        raise UserError(
            "--samples K > 1 needs sampling: --set generation.temperature=0.7 (for example)"
        )
    if out is not None:  # both files land in one directory: checked before any work
        from essa.rundir import check_output

        check_output(out, "--output")
        check_output(items_path(out), "--output")
    check_before_load(cfg, config, overrides)
    seed_everything(cfg.run.seed)
    task = load_task(cfg.data, cfg.run.seed)
    metric, reward = heldout_metric(cfg)
    check_heldout_answers(metric, task.test)
    for key, path in (("--adapter", adapter_dir), ("--sft-adapter", sft_dir)):
        if path is not None and not (path / "adapter_config.json").exists():
            raise UserError(f"{key} {path}: not a PEFT adapter directory (no adapter_config.json)")
    if sft_dir is not None and adapter_dir is None:
        raise UserError("--sft-adapter: compares with --adapter, which is not given")
    model, tokenizer = load_model(cfg.model)
    cfg, _ = resolve_lengths(cfg, tokenizer, task, say)
    if adapter_dir is not None:
        from essa.setup import load_peft_adapter

        model = load_peft_adapter(model, str(adapter_dir), "--adapter").eval()
    metrics, items = heldout_samples(cfg, model, tokenizer, task.test, samples, reward)
    drift = _drift(cfg, model, tokenizer, task.test, reward, adapter_dir, sft_dir, samples)
    result: dict[str, Any] = {
        **metrics,
        "metric": metric,
        "n": len(task.test),
        "samples": samples,
        "adapter": str(adapter_dir) if adapter_dir else None,
        "model": cfg.model.name_or_path,
        "drift": drift,
    }
    if out is not None:
        result["items"] = str(_write_items(out, items))
        out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def items_path(output: Path) -> Path:
    """Where ``--output FILE`` puts the per-item records: ``FILE`` minus .json + .items.jsonl."""
    stem = output.name.removesuffix(".json")
    return output.with_name(f"{stem}.items.jsonl")


def _write_items(output: Path, items: list[dict[str, Any]]) -> Path:
    path = items_path(output)
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


def _drift(
    cfg: Config,
    model: Any,
    tokenizer: Any,
    test: list[Any],
    reward: Any,
    adapter: Path | None,
    sft_adapter: Path | None,
    samples: int,
) -> dict[str, Any]:
    """The drift report of the evaluated model; ``samples`` K > 1 already gave pass@K on the
    whole split, so the report's own is skipped then. Without an adapter: no base to compare."""
    import contextlib
    from dataclasses import replace

    from essa.drift.models import PeftModels
    from essa.drift.report import measure
    from essa.drift.update import peft_updates
    from essa.setup import drift_settings

    settings = drift_settings(cfg)
    if samples > 1:
        settings = replace(settings, drift=replace(settings.drift, samples=0))
    sft = None
    if sft_adapter is not None:
        from essa.errors import UserError

        try:
            model.load_adapter(str(sft_adapter), adapter_name="sft")
        except (OSError, ValueError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UserError(
                f"--sft-adapter: cannot load the adapter in {sft_adapter}: {first}"
            ) from None

        @contextlib.contextmanager
        def use_sft() -> Any:
            model.set_adapter("sft")
            try:
                yield
            finally:
                model.set_adapter("default")

        sft = use_sft
    micro = settings.micro_batch_size
    models = PeftModels(model, tokenizer, micro, sft=sft, has_base=adapter is not None)
    updates = peft_updates(model, sft) if adapter is not None else None
    return measure(settings, models, tokenizer, test, reward, updates)


def heldout_samples(
    cfg: Config, model: Any, tokenizer: Any, examples: list[Any], k: int, reward: Any
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Generate k completions per problem and grade them with the held-out metric ``reward``;
    majority keys from extracted answers. Returns the metrics and one record per completion."""
    from dataclasses import replace

    from essa.backends.generate import generate_texts
    from essa.data.task import render_prompts
    from essa.metrics import sample_metrics
    from essa.rewards import extract_answer
    from essa.samples import item_records

    prompts = render_prompts(examples, cfg.data.template, tokenizer, cfg.data.system_prompt)
    rows = [p for p in prompts for _ in range(k)]  # problem-major
    # One completion per problem is greedy, as the held-out score during training; K samples
    # use generation.temperature.
    gen = cfg.generation if k > 1 else replace(cfg.generation, temperature=0.0)
    tool_use: dict[str, float] = {}
    if cfg.tools.python.max_tool_calls:  # the rollouts' tool calls, as training scores them
        from essa.backends.tool_turns import generate_turns
        from essa.tools.turns import ToolTally

        ids = tokenizer(rows, add_special_tokens=False)["input_ids"]
        texts, _, transcripts = generate_turns(
            model, tokenizer, ids, gen, cfg.tools.python,
            micro_batch_size=cfg.evaluation.micro_batch_size, seed=cfg.run.seed,
        )  # fmt: skip
        tally = ToolTally()  # the training's held-out pass counts the same (tool_line)
        finals = [extract_answer(t.turns[-1]) if t.turns else None for t in transcripts]
        tally.add(transcripts, finals)
        tool_use = tally.metrics()
    elif k == 1:  # the held-out path every recipe's held-out score takes (docs/inference.md)
        from essa.backends.evaluator import heldout_completions

        micro = cfg.evaluation.micro_batch_size
        texts, _ = heldout_completions(model, tokenizer, rows, gen, micro_batch_size=micro)
    else:
        texts, _ = generate_texts(
            model,
            tokenizer,
            rows,
            gen,
            micro_batch_size=cfg.evaluation.micro_batch_size,
            seed=cfg.run.seed,
        )
    answers = [e.answer for e in examples for _ in range(k)]
    scores = reward(texts, answers, rows)
    # pass@k and maj@k count full credit only: a graded metric (gym_score's partial credit)
    # would otherwise pass every answer that earned anything. mean_score is the held-out
    # score as training reports it (partial credit included).
    values = [float(s or 0.0) for s in scores]
    correct = [[v >= 1.0 for v in values[i * k : (i + 1) * k]] for i in range(len(examples))]
    keys = [[extract_answer(t) for t in texts[i * k : (i + 1) * k]] for i in range(len(examples))]
    metrics = sample_metrics(correct, ks=sorted({1, k}), keys=keys)
    metrics["mean_score"] = sum(values) / len(values) if values else float("nan")
    questions = [e.prompt for e in examples for _ in range(k)]
    items = item_records(questions, texts, answers, scores)
    for i, item in enumerate(items):
        item["sample"] = i % k
    if k == 1:
        metrics = {"pass@1": metrics["pass@1"], "mean_score": metrics["mean_score"]}
    return {**metrics, **tool_use}, items
