"""Pieces shared by the recipes: task splits, prompt rendering, the SFT warm start, accuracy."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from essa import seeding
from essa.config import Config, DataConfig
from essa.errors import UserError
from essa.types import AdapterVector, Example

if TYPE_CHECKING:
    from essa.adapters.svd import SVDAdapter
    from essa.dist import Comm
    from essa.harness import Harness, Reporter
    from essa.plan import TaskLengths
    from essa.protocols import Optimizer
    from essa.recipes.sft import SFTLimit

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Task:
    sft: list[Example]  # the SFT stage's examples (disjoint from train and test)
    train: list[Example]  # ESSA draws its per-generation mini-batches from here
    test: list[Example]  # held-out; never used for any choice made during training


def load_task(cfg: DataConfig, seed: int) -> Task:
    """Split the data deterministically into SFT, train and held-out test examples."""
    from essa.data import load_examples
    from essa.data.loaders import builtin_examples
    from essa.data.templates import known_templates

    if cfg.template not in known_templates():  # fail before any data or model is loaded
        raise UserError(
            f"data.template: unknown prompt template {cfg.template!r}; "
            f"known: {', '.join(known_templates())}"
        )

    if cfg.source.startswith("builtin:"):
        pool, fixed_test = builtin_examples(cfg.source)  # a fixed held-out set per task
        test = fixed_test[: cfg.test_size]
    else:
        examples = load_examples(
            cfg.source,
            question_field=cfg.question_field,
            answer_field=cfg.answer_field,
            solution_field=cfg.solution_field,
            split=cfg.split,
            params=cfg.params,
        )
        order = seeding.rng(seed, "data.test_split").permutation(len(examples))
        shuffled = [examples[i] for i in order]
        test, pool = shuffled[: cfg.test_size], shuffled[cfg.test_size :]
    # The SFT/train cut depends on the run seed: one SFT adapter per (task, seed).
    order = seeding.rng(seed, "data.sft_split").permutation(len(pool))
    pool = [pool[i] for i in order]
    sft, train = pool[: cfg.sft_size], pool[cfg.sft_size :][: cfg.train_size]
    if not train:
        raise UserError(
            f"data.source {cfg.source}: no training examples left after the "
            f"test ({cfg.test_size}) and SFT ({cfg.sft_size}) splits"
        )
    return Task(sft=sft, train=train, test=test)


def render_prompts(
    examples: Sequence[Example], template: str, tokenizer: Any, system_prompt: str | None = None
) -> list[str]:
    from essa.data.templates import render_prompts as render

    try:
        return render(template, [ex.prompt for ex in examples], tokenizer, system_prompt)
    except ValueError as err:
        raise UserError(f"data.template: {err}") from None


def check_prompt_template(cfg: Config) -> None:
    """Refuse ``data.template`` (and ``data.system_prompt``) when the model's tokenizer cannot
    render it, before the model loads: the tokenizer alone loads in about a second, a GGUF not
    converted yet is read for its header only. A real tokenizer renders one question, so that a
    chat template that fails on its own (e.g. no system role) is caught here too."""
    from essa.backends.hf import template_tokenizer
    from essa.data.templates import check_template, render_prompt

    d = cfg.data
    tokenizer = template_tokenizer(cfg.model)
    try:
        check_template(d.template, tokenizer, d.system_prompt)
        if hasattr(tokenizer, "apply_chat_template"):  # a real tokenizer, not a GGUF header
            render_prompt(d.template, "1+1=", tokenizer, d.system_prompt)
    except ValueError as err:
        raise UserError(f"data.template: {err} ({cfg.model.name_or_path})") from None


def render_splits(task: Task, data: DataConfig, tokenizer: Any) -> tuple[list[str], list[str]]:
    """(train prompts, test prompts) in ``data.template`` with ``data.system_prompt``."""
    return (
        render_prompts(task.train, data.template, tokenizer, data.system_prompt),
        render_prompts(task.test, data.template, tokenizer, data.system_prompt),
    )


def resolve_lengths(
    cfg: Config, tokenizer: Any, task: Task, say: Callable[[str], None]
) -> tuple[Config, TaskLengths]:
    """``cfg`` with ``generation.max_new_tokens: auto`` resolved on the model's tokenizer from
    the task's references (SFT targets); a fixed value too short for them is one warning."""
    from essa.plan import reference_texts
    from essa.plan import resolve_lengths as resolve

    examples = (task.sft + task.train)[:512]
    prompts = render_prompts(examples, cfg.data.template, tokenizer, cfg.data.system_prompt)
    cfg, lengths, warning = resolve(cfg, tokenizer, prompts, reference_texts(examples))
    if warning:
        say(warning)
    return cfg, lengths


def seed_everything(seed: int) -> None:
    """Seed global RNGs once, for third-party code; our own code passes explicit generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def load_base_model(cfg: Config, h: Harness) -> tuple[Any, Any]:
    """(model, tokenizer) of ``cfg.model`` on this rank's device, as the "model load" phase."""
    from essa.backends.hf import load_model
    from essa.dist import place_rank

    if cfg.backend == "vllm":
        from essa.backends.vllm import require_vllm

        require_vllm()  # before the model loads and SFT runs
    with h.phase("model load"):
        return load_model(place_rank(cfg.model, h.comm))


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
    (within ``limit``'s time and check when given: a budgeted run, essa.plan)."""
    from essa.harness import Reporter
    from essa.recipes.sft import check_target_modules, make_lora_model, save_adapter, train_sft

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
    with reporter.phase("SFT", cfg.sft.steps, unit="steps") as bar:
        losses = train_sft(
            peft_model,
            tokenizer,
            task.sft,
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


def svd_adapter(peft_model: Any, alpha: float) -> SVDAdapter:
    """The SVD form of the model's LoRA; a config that selects nothing is one UserError line."""
    from essa.adapters import SVDAdapter

    try:
        return SVDAdapter.from_peft_model(peft_model, alpha=alpha)
    except ValueError as err:  # e.g. alpha * r selects no singular value of a given adapter
        raise UserError(f"adapter: {err}") from None


def make_es_optimizer(
    cfg: Config, adapter: SVDAdapter, x0: AdapterVector | None = None
) -> Optimizer:
    """The configured optimizer over the adapter's D offsets, layerwise when configured.

    ``x0`` (D,): the initial mean; None = zeros, the SFT adapter itself. With relative steps,
    coordinates that no step can move (``SVDAdapter.searchable``: zero singular values, modules
    whose update is zero) stay at ``x0`` and the optimizer searches the others
    (essa.optimizers.subspace).
    """
    from essa.optimizers import make_optimizer
    from essa.optimizers.subspace import Subspace

    o = cfg.optimizer
    options: dict[str, Any] = (
        {"variant": o.variant, "sep_above_dim": o.sep_above_dim, "mirrored": o.mirrored}
        if o.name == "cma_es"
        else {"lr": o.lr, "step": o.step}
    )
    stds = adapter.stds() if o.use_relative_steps else None
    free = None if stds is None else adapter.searchable()  # (D,) bool
    if free is not None and free.all():
        free = None  # nothing to hold: the plain optimizer and its own checkpoint format
    options.update(
        population_size=o.population_size,
        sigma0=o.sigma0,
        seed=cfg.run.seed,
        stds=stds if free is None or stds is None else stds[free],
    )
    if x0 is not None:  # only then: layerwise checkpoints written before x0 still load
        options["x0"] = x0 if free is None else np.asarray(x0)[free]
    dim = adapter.dim if free is None else int(free.sum())
    if o.layerwise.active_layers is None:
        opt = make_optimizer(o.name, dim, **options)
    else:
        opt = _layerwise_optimizer(cfg, adapter, dim, free, options)
    if free is None:
        return opt
    return Subspace(opt, free, np.zeros(adapter.dim) if x0 is None else np.asarray(x0))


def _layerwise_optimizer(
    cfg: Config, adapter: SVDAdapter, dim: int, free: np.ndarray | None, options: dict[str, Any]
) -> Optimizer:
    """LayerwiseES over the layers' searched coordinates (renumbered into ``free``'s)."""
    from essa.adapters.layerwise import layer_blocks
    from essa.optimizers.layerwise import LayerwiseES

    o = cfg.optimizer
    try:
        blocks = layer_blocks(adapter.manifest())
    except ValueError as err:
        raise UserError(f"optimizer.layerwise: {err}") from None
    if free is not None:  # a layer without a searchable value drops out of the schedule
        index = np.cumsum(free) - 1  # (D,) position among the searched coordinates
        blocks = [b for b in ([int(index[i]) for i in block if free[i]] for block in blocks) if b]
    assert o.layerwise.active_layers is not None
    if o.layerwise.active_layers > len(blocks):
        raise UserError(
            f"optimizer.layerwise.active_layers: must be in 1..{len(blocks)} (the adapter's "
            f"layers), got {o.layerwise.active_layers}"
        )
    return LayerwiseES(
        dim,
        layer_indices=blocks,
        active_layers=o.layerwise.active_layers,
        interval=o.layerwise.interval,
        base=o.name,
        use_carried_sigma=o.layerwise.use_carried_sigma,
        **options,
    )


def check_searchable(cfg: Config, adapter: SVDAdapter, adapter_dir: str) -> None:
    """Refuse, in one line, an adapter (loaded from ``adapter_dir``) whose update gamma * B A
    no search step can move.

    With relative steps a zero singular value stays zero, and a zero factor keeps B'A' zero:
    an untrained LoRA (B at PEFT's zero init) has nothing to search. With absolute steps only
    gamma = 0 (lora_alpha 0) leaves nothing to search.
    """
    if cfg.optimizer.use_relative_steps:
        if adapter.searchable().any():
            return
    elif any(module.gamma != 0 for module in adapter.modules):
        return
    where = f"adapter.path: {adapter_dir}" if cfg.adapter.path else f"sft: {adapter_dir}"
    raise UserError(
        f"{where} is an untrained LoRA (in every module B or A is zero, or lora_alpha is 0), "
        "so ESSA has no singular value to search; use a trained adapter (adapter.path) or "
        "train one first (sft.steps > 0, adapter.lora_alpha > 0)"
    )


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


def one_process_harness(
    cfg: Config, run_dir: Path, *, resume: bool, console: Any, comm: Comm | None
) -> Harness:
    """The gradient recipes' harness (unit: steps); they refuse to run on more than one rank."""
    from essa.dist import get_comm
    from essa.harness import Harness

    comm = get_comm() if comm is None else comm
    if comm.world_size > 1:
        raise UserError(
            f"algorithm: {cfg.algorithm} runs in one process for now (got {comm.world_size} "
            "ranks); launch it without mpiexec/srun"
        )
    return Harness(cfg, run_dir, resume=resume, console=console, comm=comm, unit="steps")
