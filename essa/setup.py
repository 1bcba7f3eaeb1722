"""The set-up every recipe shares: seeds, the base model, the SFT-or-loaded adapter on every
rank, the task's generation lengths."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from essa.config import Config
from essa.data.task import Task, load_task, render_prompts
from essa.errors import UserError

if TYPE_CHECKING:
    from essa.backends import EvaluatorSettings
    from essa.dist import Comm
    from essa.drift.report import DriftSettings
    from essa.es.plan import PlanInputs, TaskLengths
    from essa.gradient.sft import SFTLimit
    from essa.harness import Harness, Reporter
    from essa.types import Example

log = logging.getLogger(__name__)


def resolve_lengths(
    cfg: Config, tokenizer: Any, task: Task, say: Callable[[str], None]
) -> tuple[Config, TaskLengths]:
    """``cfg`` with ``generation.max_new_tokens: auto`` resolved on the model's tokenizer from
    the task's references (SFT targets); a fixed value too short for them is one warning."""
    from essa.es.plan import reference_texts
    from essa.es.plan import resolve_lengths as resolve

    examples = (task.sft + task.train)[:512]
    t = cfg.tools.python
    if t.max_tool_calls and t.sft_with_code:  # a turn may write a whole code-call target
        from essa.data.tool_sft import with_tool_targets

        examples, _ = with_tool_targets(examples, t, t.answer_format)
    prompts = render_prompts(examples, cfg.data.template, tokenizer, cfg.data.system_prompt)
    gen, lengths, warning = resolve(cfg.generation, tokenizer, prompts, reference_texts(examples))
    if warning:
        say(warning)
    return dataclasses.replace(cfg, generation=gen), lengths


def plan_inputs(cfg: Config) -> PlanInputs:
    """The sections of ``cfg`` that the budget plan reads."""
    from essa.es.plan import PlanInputs

    return PlanInputs(
        cfg.run,
        cfg.optimizer,
        cfg.data,
        cfg.generation,
        cfg.evaluation,
        cfg.sft,
        cfg.adapter,
        cfg.backend,
    )


def evaluator_settings(cfg: Config) -> EvaluatorSettings:
    """The sections of ``cfg`` that a population evaluator reads."""
    from essa.backends import EvaluatorSettings

    o = cfg.optimizer
    return EvaluatorSettings(
        cfg.generation,
        cfg.evaluation,
        cfg.model,
        cfg.vllm,
        cfg.run.seed,
        o.population_size,
        cfg.backend,
        cfg.tools.calls,
    )


def drift_settings(cfg: Config) -> DriftSettings:
    """The sections of ``cfg`` that the drift report reads."""
    from essa.drift.report import DriftSettings

    return DriftSettings(
        cfg.evaluation.drift,
        cfg.data,
        cfg.generation,
        cfg.evaluation.micro_batch_size,
        cfg.run.seed,
        cfg.tools.calls,
    )


def seed_everything(seed: int) -> None:
    """Seed global RNGs once, for third-party code; our own code passes explicit generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def load_base_model(cfg: Config, h: Harness) -> tuple[Any, Any]:
    """(model, tokenizer) of ``cfg.model`` on this rank's device, as the "model load" phase."""
    from essa.backends.models import compute_record, dtype_choice, load_model
    from essa.dist import place_rank

    if cfg.backend == "vllm":
        from essa.backends.vllm import require_vllm

        require_vllm()  # before the model loads and SFT runs
    model_cfg = place_rank(cfg.model, h.comm)
    if (line := dtype_choice(model_cfg)) is not None:
        h.say(line)
    h.compute = compute_record(model_cfg)  # the summary's "compute" (rank 0's)
    with h.phase("model load"):
        model, tokenizer = load_model(model_cfg)
    if model_cfg.dtype == "auto":  # the checkpoint's own dtype, known once it is loaded
        h.compute["dtype"] = str(getattr(model, "dtype", "auto")).removeprefix("torch.")
    return model, tokenizer


def load_or_train_adapter(
    cfg: Config,
    model: Any,
    tokenizer: Any,
    task: Task,
    run_dir: Path,
    reporter: Reporter | None = None,
    limit: SFTLimit | None = None,
) -> tuple[Any, str]:
    """Return (peft_model, adapter_dir): the configured adapter, a saved SFT one, or a new SFT
    (within ``limit``'s time and check when given: a budgeted run, essa.es.plan)."""
    from essa.gradient.sft import check_target_modules, make_lora_model, save_adapter, train_sft
    from essa.harness import Reporter

    reporter = reporter or Reporter(None)
    path = cfg.adapter.path
    if path is None and (run_dir / "sft_adapter" / "adapter_config.json").exists():
        path = str(run_dir / "sft_adapter")  # resumed run: reuse this run's SFT
    if path is not None:
        if not (Path(path) / "adapter_config.json").exists():
            raise UserError(
                f"adapter.path: {path} is not a PEFT adapter directory (no adapter_config.json)"
            )
        targets = _adapter_targets(Path(path))
        check_target_modules(model, targets)
        return load_peft_adapter(model, path, "adapter.path"), path
    if cfg.sft.trainable != "lora":
        raise UserError(
            f"sft.trainable: {cfg.sft.trainable} trains the base weights, but this stage needs a "
            "LoRA SFT adapter; use sft.trainable=lora here (`essa sft` alone trains full/LISA)"
        )
    peft_model = make_lora_model(model, cfg.adapter)
    prompts = render_prompts(task.sft, cfg.data.template, tokenizer, cfg.data.system_prompt)
    examples = sft_examples(cfg, task, reporter)
    with reporter.phase("SFT", cfg.sft.steps, unit="steps") as bar:
        losses = train_sft(
            peft_model,
            tokenizer,
            examples,
            prompts,
            cfg.sft,
            cfg.run.seed,
            progress=lambda fields: bar.advance(1, **fields),
            limit=limit,
        )
    if losses:
        why = (
            ""
            if limit is None or limit.stopped == "steps"
            else f" (stopped on its {limit.stopped})"
        )
        reporter.say(
            f"SFT: {len(losses)} steps on {len(task.sft)} examples, "
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f}{why}"
        )
    out = save_adapter(peft_model, run_dir / "sft_adapter")
    return peft_model, str(out)


def sft_examples(cfg: Config, task: Task, reporter: Reporter) -> list[Example]:
    """The SFT stage's examples: with tool calls and ``tools.python.sft_with_code``, those a
    solver reads get a code-and-output target (essa.data.tool_sft); the rest keep theirs."""
    t = cfg.tools.python
    if not t.max_tool_calls or not t.sft_with_code:
        return task.sft
    from essa.data.tool_sft import with_tool_targets

    examples, made = with_tool_targets(task.sft, t, t.answer_format)
    reporter.say(f"SFT: {made} of {len(examples)} examples have a tool-call target")
    return examples


def adapter_on_every_rank(
    cfg: Config, model: Any, tokenizer: Any, task: Task, h: Harness, limit: SFTLimit | None = None
) -> tuple[Any, str]:
    """Rank 0 loads or trains (and saves) the adapter; then the other ranks load the saved one.

    Loading rank 0's saved SFT adapter, rather than training it on every rank, gives every
    replica bit-identical singular values even where training is not deterministic (GPU kernels).
    """
    if h.is_root:
        loaded = load_or_train_adapter(cfg, model, tokenizer, task, h.run_dir, h.reporter, limit)
    h.comm.barrier()
    if not h.is_root:
        if cfg.adapter.path is None and not (h.run_dir / "sft_adapter").is_dir():
            raise UserError(
                f"run.dir {h.run_dir}: rank {h.comm.rank} cannot see the SFT adapter rank 0 "
                "saved there; with ranks on several nodes run.dir must be on a shared filesystem"
            )
        loaded = load_or_train_adapter(cfg, model, tokenizer, task, h.run_dir, h.reporter)
    return loaded


def load_peft_adapter(model: Any, path: str, key: str) -> Any:
    """``PeftModel.from_pretrained`` with load failures as one-line UserErrors naming ``key``.

    PEFT reads adapter_model.safetensors, or unpickles adapter_model.bin with
    ``weights_only=True`` (tensors only): a pickle that would run code is refused here.
    """
    import pickle

    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(model, path)
    except (OSError, ValueError, pickle.UnpicklingError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"{key}: cannot load the adapter in {path}: {first}") from None


def _adapter_targets(path: Path) -> list[str]:
    import json

    cfg = json.loads((path / "adapter_config.json").read_text())
    targets = cfg.get("target_modules") or []
    return [targets] if isinstance(targets, str) else list(targets)


def open_run(
    cfg: Config,
    run_dir: Path,
    *,
    resume: bool,
    console: Any,
    comm: Comm | None,
    gradient: bool,
) -> tuple[Harness, Task]:
    """Every recipe's first step: the harness, the seeded global RNGs and the task's splits,
    with the held-out split checked before anything loads. ``gradient``: a gradient recipe,
    which runs in one process and counts steps."""
    from essa.dist import get_comm
    from essa.harness import Harness

    comm = get_comm() if comm is None else comm
    if gradient and comm.world_size > 1:
        raise UserError(
            f"algorithm: {cfg.algorithm} runs in one process for now (got {comm.world_size} "
            "ranks); launch it without mpiexec/srun"
        )
    unit = "steps" if gradient else "generations"
    h = Harness(cfg, run_dir, resume=resume, console=console, comm=comm, unit=unit)
    seed_everything(cfg.run.seed)
    task = load_task(cfg.data, cfg.run.seed)
    h.check_heldout(task.test)  # before the model loads
    return h, task


def open_model(cfg: Config, h: Harness, task: Task) -> tuple[Config, Any, Any, int, TaskLengths]:
    """(cfg with its lengths resolved, model, tokenizer, the base weights' bytes as stored, the
    task's lengths), inside the harness: the "model load" phase, then
    ``generation.max_new_tokens: auto``."""
    from essa.backends.memory import model_bytes

    model, tokenizer = load_base_model(cfg, h)
    base_bytes = model_bytes(model)  # quantised weights counted packed, as stored
    cfg, lengths = resolve_lengths(cfg, tokenizer, task, h.say)
    return cfg, model, tokenizer, base_bytes, lengths
