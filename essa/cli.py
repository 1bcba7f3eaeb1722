"""The ``essa`` command line: train, sft, eval, export, compare, config show/validate.

User errors (bad config, missing files, bad data) print one line ``error: ...`` on stderr and
exit with code 2; they never print a traceback.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from essa.config import (
    Config,
    ConfigError,
    dump_config,
    load_config,
    tiny_sft_warning,
)
from essa.errors import UserError

# Plain click help (rich_markup_mode=None): one paragraph per docstring, line breaks joined, and
# no type column that would show `--help <bool>`.
app = typer.Typer(
    add_completion=False,
    no_args_is_help=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Align language models without gradients: ESSA searches a LoRA's singular values.",
)
config_app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Print or check config files.",
)
app.add_typer(config_app, name="config")

F = TypeVar("F", bound=Callable[..., Any])

ConfigArg = Annotated[
    Path | None, typer.Argument(metavar="CONFIG", help="YAML config (default: the embedded demo)")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", metavar="KEY=VALUE", help="Override, e.g. optimizer.sigma0=0.2"),
]


def _user_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [ConfigError, UserError]
    try:
        from essa.data import DataError

        errors.append(DataError)
    except ImportError:
        pass
    return tuple(errors)


def guarded(fn: F) -> F:
    """Turn user errors into one line on stderr and exit code 2.

    Under MPI (two or more ranks) any error, on any rank, is printed once and ends every rank
    through MPI_Abort (code 2 for user errors, 1 otherwise), so no rank is left blocked in a
    collective (essa/dist/mpi.py).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from essa.dist import abort_all_ranks

        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except _user_errors() as err:
            # One line, even when the message quotes user text with line breaks in it.
            text = str(err).replace("\r", "\\r").replace("\n", "\\n")
            abort_all_ranks(f"error: {text}", 2)  # returns only outside a multi-rank MPI job
            typer.echo(f"error: {text}", err=True)
            raise typer.Exit(2) from None
        except Exception:
            abort_all_ranks(traceback.format_exc().rstrip(), 1)
            raise

    return wrapper  # type: ignore[return-value]


def _console() -> Any:
    from rich.console import Console

    return Console(stderr=False)


def _setup_logging() -> None:
    logging.basicConfig(
        level=os.environ.get("ESSA_LOG_LEVEL", "WARNING"),
        format="%(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    from transformers.utils import logging as hf_logging

    # Library chatter (weight-loading bars, deprecation notices) buries our own progress.
    hf_logging.set_verbosity_error()
    # bitsandbytes warns at import about an optional kernels package even when unused.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    hf_logging.disable_progress_bar()
    _no_bars_off_a_terminal()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="peft")


def _no_bars_off_a_terminal() -> None:
    """Turn tqdm's bars off where stderr is not a terminal (a file: Slurm, nohup). They redraw
    in place with carriage returns, which a file keeps as one endless line; the libraries that
    draw them outside transformers' switch (the GGUF conversion, hub downloads) are covered
    too. Our phases print plain lines there instead (essa.harness.Reporter)."""
    import sys

    if sys.stderr.isatty():
        return
    from huggingface_hub.utils import disable_progress_bars
    from tqdm import std

    disable_progress_bars()
    if not getattr(std.tqdm, "_essa_off", False):  # once per process
        # A partial default: a caller's own disable= still wins.
        std.tqdm.__init__ = functools.partialmethod(std.tqdm.__init__, disable=True)  # type: ignore[method-assign]
        std.tqdm._essa_off = True  # type: ignore[attr-defined]


def _resolve(config: Path | None, overrides: list[str] | None) -> Config:
    return load_config(config, overrides or ())


@app.command()
@guarded
def train(
    config: ConfigArg = None,
    set_: SetOpt = None,
    resume: Annotated[Path | None, typer.Option(help="Continue the run in this directory")] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an existing run directory")
    ] = False,
    run_dir: Annotated[Path | None, typer.Option(help="Run directory (overrides run.dir)")] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Also print the run's summary.json on stdout, last")
    ] = False,
) -> None:
    """Train an adapter with ESSA or the config's algorithm.

    SFT runs first when the config names no adapter. Under mpiexec or srun every rank runs this
    command (docs/scaling.md).
    """
    from essa.api import train_run
    from essa.dist import get_comm

    comm = get_comm()
    _setup_logging()
    run = train_run(
        config,
        overrides=set_ or (),
        run_dir=resume if resume is not None else run_dir,
        resume=resume is not None,
        overwrite=overwrite,
        console=_console(),
        comm=comm,
    )
    if comm.rank == 0:
        typer.echo("\n".join(closing_lines(run.run_dir, run.summary, run.unit)))
        if as_json:
            typer.echo(json.dumps(run.summary, indent=2))


def closing_lines(run_dir: Path, summary: dict[str, Any], unit: str) -> list[str]:
    """The last lines of a run: the held-out score from start to end, the time, what was
    exported and where, and the commands that come next. The whole summary is summary.json."""
    import shlex

    run = shlex.quote(str(run_dir))
    exported = Path(summary.get("adapter_dir") or run_dir / "adapter")
    point = summary.get("exported", {}).get("point") if summary.get("exported") else None
    lines = [
        f"held-out {summary['heldout_metric']} {summary['baseline_accuracy']:.3f} -> "
        f"{summary['final_accuracy']:.3f} ({summary['improvement']:+.3f}) after "
        f"{summary['generations']} {unit} in {summary['wall_seconds']:.0f} s",
        f"summary:  {run_dir / 'summary.json'} (printed by --json)",
    ]
    if "tool_rows_0_calls" in summary.get("tools", {}):
        lines.insert(1, tool_line(summary["tools"]))
    q = shlex.quote(str(exported))
    if (exported / "adapter_config.json").is_file() or not exported.exists():
        lines.append(f"adapter:  {exported}" + (f" ({point})" if point else ""))
        lines.append(f"evaluate: essa eval {run}/config.yaml --adapter {q}")
        lines.append(f"compare:  essa compare {run} OTHER_RUN_DIR --output {run}/compare")
        lines.append(f"export:   essa export {run} --merged {run}/merged")
    else:  # a whole model (ScaleBiO): it loads as the model itself, nothing to merge
        lines.append(f"model:    {exported}")
        lines.append(f"evaluate: essa eval {run}/config.yaml --set model.name_or_path={q}")
        lines.append(f"compare:  essa compare {run} OTHER_RUN_DIR --output {run}/compare")
    return lines


def tool_line(tools: dict[str, float]) -> str:
    """The final held-out pass's tool use in one line (essa.tools.turns.ToolTally's metrics).

    >>> for part in tool_line({"tool_rows_0_calls": 0.1, "tool_rows_1_call": 0.8,
    ...     "tool_rows_2plus_calls": 0.1, "tool_calls_per_row": 1.0, "tool_error_rate": 0.05,
    ...     "tool_void_rows": 0}).split(", "):
    ...     print(part)
    tools:    answers with 0 / 1 / 2+ calls 0.10 / 0.80 / 0.10
    1.00 calls each
    0.05 of runs failed
    0.00 with a void turn
    """
    return (
        f"tools:    answers with 0 / 1 / 2+ calls {tools['tool_rows_0_calls']:.2f} / "
        f"{tools['tool_rows_1_call']:.2f} / {tools['tool_rows_2plus_calls']:.2f}, "
        f"{tools['tool_calls_per_row']:.2f} calls each, {tools['tool_error_rate']:.2f} of runs "
        f"failed, {tools['tool_void_rows']:.2f} with a void turn"
    )


@app.command()
@guarded
def sft(
    config: ConfigArg = None,
    set_: SetOpt = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an existing run directory")
    ] = False,
    run_dir: Annotated[Path | None, typer.Option(help="Run directory (overrides run.dir)")] = None,
) -> None:
    """Train only the SFT adapter and save it in the run directory.

    A LoRA goes to RUN_DIR/sft_adapter; with sft.trainable full or lisa the whole model goes to
    RUN_DIR/sft_model.
    """
    from essa.api import check_before_load
    from essa.backends.models import load_model
    from essa.data.task import load_task
    from essa.rundir import prepare_run_dir
    from essa.setup import load_or_train_adapter, seed_everything

    _setup_logging()
    cfg = _resolve(config, set_)
    directory = run_dir or Path(cfg.run.dir)
    if cfg.adapter.path is not None:
        raise UserError("adapter.path is set: `essa sft` trains a new adapter; unset it")
    check_before_load(cfg, config, set_ or ())
    warning = tiny_sft_warning(cfg)
    if warning is not None:
        typer.echo(warning, err=True)
    prepare_run_dir(directory, resume=False, overwrite=overwrite)
    (directory / "config.yaml").write_text(dump_config(cfg))
    seed_everything(cfg.run.seed)
    task = load_task(cfg.data, cfg.run.seed)
    from essa.harness import Reporter

    reporter = Reporter(_console(), show_progress=cfg.run.show_progress)
    with reporter.phase("model load"):  # off a terminal: a line while a large model loads
        model, tokenizer = load_model(cfg.model)
    if cfg.sft.trainable != "lora":
        from essa.gradient.lisa import train_base_model

        model_dir, losses = train_base_model(
            cfg.sft, cfg.data, cfg.run.seed, model, tokenizer, task, directory
        )
        typer.echo(f"SFT ({cfg.sft.trainable}): loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        typer.echo(f"SFT model: {model_dir}")
        return
    _, adapter_dir = load_or_train_adapter(cfg, model, tokenizer, task, directory, reporter)
    typer.echo(f"SFT adapter: {adapter_dir}")


@app.command("eval")
@guarded
def evaluate(
    config: ConfigArg = None,
    set_: SetOpt = None,
    adapter: Annotated[
        Path | None, typer.Option(help="PEFT adapter directory (default: none)")
    ] = None,
    samples: Annotated[
        int,
        typer.Option(help="Completions per problem: 1 is greedy; >1 samples (temperature > 0)"),
    ] = 1,
    output: Annotated[
        Path | None,
        typer.Option(help="Write the JSON result here, and per-item records to FILE.items.jsonl"),
    ] = None,
    sft_adapter: Annotated[
        Path | None,
        typer.Option(help="The SFT adapter --adapter started from: KL(SFT || tuned) in drift"),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the whole result as JSON instead of its summary")
    ] = False,
) -> None:
    """Score a model or adapter on the held-out split.

    The score is evaluation.metric. Prints pass@1 (full credit) and mean_score (partial credit
    included, as training reports it); with --samples K also avg@K, pass@K and maj@K; and drift:
    off-task KL to the base (and SFT) model, update size, retention and pass@K (docs/drift.md).
    """
    from essa.api import evaluate as evaluate_model

    _setup_logging()
    result = evaluate_model(
        config,
        overrides=set_ or (),
        adapter=adapter,
        samples=samples,
        output=output,
        sft_adapter=sft_adapter,
    )
    text = json.dumps(result, indent=2)
    typer.echo(text if as_json else "\n".join(eval_lines(result, output)))


def eval_lines(result: dict[str, Any], output: Path | None) -> list[str]:
    """``essa eval``'s summary: the scores, the drift's headline figures, where the whole
    result went (the JSON: --json on stdout, --output in a file)."""
    from essa.drift.report import summary_line

    scores = ", ".join(f"{k} {v:.3f}" for k, v in result.items() if "@" in k or k == "mean_score")
    model = result["model"] + (f" + {result['adapter']}" if result["adapter"] else "")
    lines = [f"held-out {result['metric']} on {result['n']} items ({model}): {scores}"]
    if "tool_calls_per_row" in result:
        lines.append(tool_line(result))
    drift = summary_line(result.get("drift") or {})
    if drift is not None:
        lines.append(drift)
    if output is not None:
        lines.append(f"result:   {output} (items: {result['items']})")
    return lines


@app.command("export")
@guarded
def export(
    run_dir: Annotated[Path, typer.Argument(metavar="RUN_DIR", help="A finished run directory")],
    merged: Annotated[
        Path, typer.Option(help="Write the adapter merged into the base here (plain HF model)")
    ],
    adapter: Annotated[
        Path | None, typer.Option(help="PEFT adapter to merge (default: RUN_DIR/adapter)")
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an existing output directory")
    ] = False,
) -> None:
    """Merge a run's adapter into its base model for serving.

    The result is a plain checkpoint that transformers and vLLM load without PEFT.
    """
    from essa.backends.merge_export import export_merged

    _setup_logging()
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"{run_dir}: not a run directory (no config.yaml)")
    if merged.exists() and not overwrite:
        raise UserError(f"{merged} exists; pass --overwrite to replace it")
    cfg = _with_run_lengths(load_config(run_dir / "config.yaml"), run_dir)
    adapter_dir = adapter or run_dir / "adapter"
    if not (adapter_dir / "adapter_config.json").is_file():  # before the base model loads
        option = "--adapter " if adapter is not None else ""
        raise UserError(
            f"{option}{adapter_dir}: not a PEFT adapter directory (no adapter_config.json)"
        )
    from essa.rundir import check_output

    check_output(merged, "--merged", directory=True)
    result = export_merged(cfg.model, cfg.generation, adapter_dir, merged)
    if result.note:
        typer.echo(f"note: {result.note}", err=True)
    typer.echo(
        f"merged {result.adapter_dir} into {result.base} ({result.dtype}): {result.out_dir}\n"
        f"load it with AutoModelForCausalLM.from_pretrained({str(result.out_dir)!r}) "
        f"or serve it: vllm serve {result.out_dir}"
    )


def _with_run_lengths(cfg: Config, run_dir: Path) -> Config:
    """``cfg`` with generation.max_new_tokens as the run resolved it (auto -> its summary's)."""
    import dataclasses

    summary = run_dir / "summary.json"
    if cfg.generation.max_new_tokens != "auto" or not summary.is_file():
        return cfg
    resolved = json.loads(summary.read_text()).get("max_new_tokens")
    if not isinstance(resolved, int):
        return cfg
    gen = dataclasses.replace(cfg.generation, max_new_tokens=resolved)
    return dataclasses.replace(cfg, generation=gen)


@app.command()
@guarded
def compare(
    run_dirs: Annotated[
        list[Path], typer.Argument(metavar="RUN_DIR", help="Finished run directories")
    ],
    output: Annotated[Path, typer.Option(help="Where compare.md and compare.png go")] = Path(
        "runs/compare"
    ),
    target: Annotated[float, typer.Option(help="Held-out accuracy to time")] = 0.9,
) -> None:
    """Compare finished runs in a table and a plot.

    The Markdown table and the PNG show held-out accuracy and training reward against seconds
    and generated tokens.
    """
    from essa.compare import compare as write_comparison
    from essa.rundir import check_output

    check_output(output, "--output", directory=True)
    text = write_comparison(run_dirs, output, target)
    typer.echo(text)
    typer.echo(f"\nwrote {output / 'compare.md'} and {output / 'compare.png'}")


@config_app.command("show")
@guarded
def config_show(config: ConfigArg = None, set_: SetOpt = None) -> None:
    """Print the resolved config with defaults and overrides applied."""
    typer.echo(dump_config(_resolve(config, set_)), nl=False)


@config_app.command("validate")
def config_validate(
    paths: Annotated[list[Path], typer.Argument(metavar="CONFIG", help="Config files")],
) -> None:
    """Check config files and exit with code 2 if any is invalid."""
    bad = 0
    for path in paths:
        try:
            load_config(path)
            typer.echo(f"ok: {path}")
        except ConfigError as err:
            typer.echo(f"error: {str(err).replace(chr(10), chr(92) + 'n')}", err=True)
            bad += 1
    if bad:
        raise typer.Exit(2)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
