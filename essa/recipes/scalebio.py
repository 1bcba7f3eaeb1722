"""ScaleBiO (Pan et al., arXiv 2406.19976): SFT over a mixture of sources whose weights are
learned by first-order bilevel optimization, the models trained with LISA.

Bilevel problem: upper level min_w L_val(theta*(w)), lower level
theta*(w) = argmin_theta sum_k w_k L_k(theta), with w = softmax(a) over the ``data.sources``.
The first-order (value-function penalty) reformulation the paper scales up keeps two models,
theta (upper) and u (the lower-level solver), and minimises
L_val(theta) + lambda * (sum_k w_k L_k(theta) - sum_k w_k L_k(u)) with single gradient steps:

    u     <- LISA-AdamW step on   sum_k w_k L_k(u)
    theta <- LISA-AdamW step on   L_val(theta) + lambda * sum_k w_k L_k(theta)
    a     <- a - eta * lambda * w * (d - w.d),   d_k = L_k(theta) - L_k(u)

(the last is the gradient in a of the penalty through the softmax: :func:`weight_update`).
A source whose loss the validation-guided theta keeps higher than the plain mixture solver u
conflicts with the validation data and loses weight. The validation set is the ``sft`` split of
``data.source`` (``data.sft_size`` examples); held-out accuracy is greedy on its test split and
never feeds back into training. Formulas and choices: docs/dpo-scalebio.md.

Deviations from the paper and project choices:
* lambda is constant (``scalebio.penalty``); the paper's schedule grows it during training;
* the three updates are simultaneous: every loss is taken at the step's start (theta_t, u_t,
  a_t), then all three move; the step on a is plain SGD with rate ``scalebio.weight_lr``;
* every step draws ``scalebio.batch_size`` examples from every source (per-source losses for d)
  and as many from the validation set; the mixture weights scale the losses, not the sampling;
* theta and u are two full copies of the base model, each with its own LISA optimizer on the
  same layer schedule (the seed is shared), so both train the same blocks in an interval;
* no SFT LoRA stage: ScaleBiO is the SFT; it starts from the base weights and exports theta as a
  whole model (RUN_DIR/model, with the tokenizer);
* source examples whose question is in the held-out test or the validation set are dropped;
* one process only: under MPI with two or more ranks the recipe refuses to start.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from essa import seeding
from essa.config import Config, to_dict
from essa.dist import Comm
from essa.errors import UserError
from essa.gradient.policy import Policy
from essa.harness import Harness
from essa.recipes import grpo
from essa.rundir import atomic_dir, recover, storage_error
from essa.types import Example

if TYPE_CHECKING:
    from essa.data.task import Task
    from essa.gradient.lisa import LisaOptimizer


def run(
    cfg: Config,
    run_dir: Path,
    *,
    resume: bool = False,
    console: Any = None,
    comm: Comm | None = None,
) -> dict[str, Any]:
    """Train with ScaleBiO; return the summary (also in summary.json)."""
    from essa import setup
    from essa.backends.memory import model_bytes
    from essa.data.task import load_task

    h = setup.one_process_harness(cfg, run_dir, resume=resume, console=console, comm=comm)
    setup.seed_everything(cfg.run.seed)
    task = load_task(cfg.data, cfg.run.seed)
    h.check_heldout(task.test)
    sources = load_sources(cfg, task)  # before the model loads
    with h:
        model, tokenizer = setup.load_base_model(cfg, h)
        cfg, _ = setup.resolve_lengths(cfg, tokenizer, task, h.say)
        base_bytes = model_bytes(model)
        models = _Models.build(cfg, model)
        data = _Data.build(cfg, task, sources, tokenizer)
        state = _load_checkpoint(run_dir, models) if resume else None
        state = h.restore(state, done=state["step"] if state else 0)
        if state is None:
            state = _initial_state(cfg, h, models, tokenizer, data)
        h.say(
            f"ScaleBiO over {', '.join(data.names)} (validation {len(task.sft)}): "
            f"LISA {cfg.scalebio.lisa.active_layers} blocks, lambda {cfg.scalebio.penalty}, "
            f"held-out {h.metric_name} baseline {state['baseline_accuracy']:.3f}"
        )
        for step in h.steps(state["step"], show=_shown):
            record = train_step(cfg, models, tokenizer, data, state, step.index)
            if h.due(step.index, cfg.evaluation.every):
                record["heldout_accuracy"] = grpo.heldout_accuracy(
                    models.policy, tokenizer, data.heldout, cfg, h, generation=step.index
                )
            state.update(step=step.index + 1, elapsed=h.elapsed)
            step.finish(record, lambda: _save_checkpoint(run_dir, models, state))
        state["model_bytes"] = base_bytes
        return _finish(cfg, h, models, tokenizer, data, state)


# ---------------------------------------------------------------------------------------------
# The update of the source weights


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max())
    return z / z.sum()


def weight_update(
    logits: np.ndarray,
    loss_theta: np.ndarray,
    loss_u: np.ndarray,
    penalty: float,
    lr: float,
) -> np.ndarray:
    """One SGD step on the source-weight logits a (K,), given per-source losses (K,).

    The penalty lambda * sum_k w_k (L_k(theta) - L_k(u)) has gradient
    lambda * J^T d in a, with J = diag(w) - w w^T the softmax Jacobian: lambda * w * (d - w.d).
    """
    w = softmax(logits)
    d = loss_theta - loss_u  # (K,)
    grad = penalty * w * (d - w @ d)  # (K,)
    return logits - lr * grad


# ---------------------------------------------------------------------------------------------
# Data and models


def load_sources(cfg: Config, task: Task) -> dict[str, list[Example]]:
    """Each ``data.sources`` entry's examples, without the test's or validation's questions."""
    from essa.data import DataError, load_examples

    d = cfg.data
    reserved = {e.prompt for e in task.test} | {e.prompt for e in task.sft}
    out: dict[str, list[Example]] = {}
    for name, path in d.sources.items():
        try:
            examples = load_examples(
                path,
                question_field=d.question_field,
                answer_field=d.answer_field,
                solution_field=d.solution_field,
            )
        except DataError as err:
            raise UserError(f"data.sources.{name}: {err}") from None
        kept = [e for e in examples if e.prompt not in reserved]
        if not kept:
            raise UserError(
                f"data.sources.{name}: no example left once the held-out and validation "
                f"questions of {d.source} are removed"
            )
        out[name] = kept
    return out


@dataclass(frozen=True)
class _Data:
    names: list[str]
    sources: list[list[Example]]  # per source
    source_prompts: list[list[str]]
    validation: list[Example]
    validation_prompts: list[str]
    heldout: grpo._Data  # the test split, as grpo.heldout_accuracy takes it

    @classmethod
    def build(
        cls, cfg: Config, task: Task, sources: dict[str, list[Example]], tokenizer: Any
    ) -> _Data:
        from essa.data.task import render_prompts

        def render(examples: Sequence[Example]) -> list[str]:
            return render_prompts(examples, cfg.data.template, tokenizer, cfg.data.system_prompt)

        test_prompts = render(task.test)
        return cls(
            names=list(sources),
            sources=list(sources.values()),
            source_prompts=[render(v) for v in sources.values()],
            validation=task.sft,
            validation_prompts=render(task.sft),
            heldout=grpo._Data([], [], task.test, test_prompts),
        )


@dataclass
class _Models:
    """theta (the upper-level model, exported) and u (the lower-level solver), each with LISA."""

    theta: Any
    u: Any
    theta_optimizer: LisaOptimizer
    u_optimizer: LisaOptimizer

    @classmethod
    def build(cls, cfg: Config, model: Any) -> _Models:
        from essa.gradient.lisa import LisaOptimizer

        s = cfg.scalebio
        models = [model.eval(), copy.deepcopy(model).eval()]
        optimizers = [
            LisaOptimizer(
                m,
                active_layers=s.lisa.active_layers,
                interval=s.lisa.interval,
                seed=cfg.run.seed,  # shared: theta and u train the same blocks
                lr=s.lr,
                weight_decay=s.weight_decay,
                train_embeddings=s.lisa.train_embeddings,
                train_head=s.lisa.train_head,
                config_key="scalebio.lisa",
            )
            for m in models
        ]
        return cls(models[0], models[1], optimizers[0], optimizers[1])

    @property
    def policy(self) -> Policy:
        """theta seen as a GRPO policy, for the held-out pass."""
        return Policy(self.theta, list(self.theta.parameters()), [])

    def parts(self) -> list[tuple[str, Any, LisaOptimizer]]:
        return [("theta", self.theta, self.theta_optimizer), ("u", self.u, self.u_optimizer)]


# ---------------------------------------------------------------------------------------------
# One step


def _draw(cfg: Config, size: int, step: int, stream: int) -> list[int]:
    """A seeded draw of batch_size indices without replacement (fewer when size is smaller)."""
    rng = seeding.rng(cfg.run.seed, "scalebio.batches", step, stream)
    return rng.choice(size, size=min(cfg.scalebio.batch_size, size), replace=False).tolist()


def _sft_loss(
    model: Any, tokenizer: Any, examples: Sequence[Example], prompts: Sequence[str], cfg: Config
) -> torch.Tensor:
    """Mean token cross-entropy of the solutions (and EOS) given the prompts: ()."""
    from essa.gradient.sft import encode_sft_batch

    batch = encode_sft_batch(tokenizer, examples, prompts, cfg.scalebio.max_length)
    device = next(model.parameters()).device
    return model(**{k: v.to(device) for k, v in batch.items()}).loss


def train_step(
    cfg: Config,
    models: _Models,
    tokenizer: Any,
    data: _Data,
    state: dict[str, Any],
    step: int,
) -> dict[str, Any]:
    """The three simultaneous updates of the module docstring; returns the step's record."""
    s = cfg.scalebio
    start = time.perf_counter()
    logits = np.asarray(state["logits"], dtype=np.float64)  # (K,)
    w = softmax(logits)
    batches = []
    for k, examples in enumerate(data.sources):
        idx = _draw(cfg, len(examples), step, k)
        batches.append(([examples[i] for i in idx], [data.source_prompts[k][i] for i in idx]))
    idx = _draw(cfg, len(data.validation), step, len(data.sources))
    validation = ([data.validation[i] for i in idx], [data.validation_prompts[i] for i in idx])
    # Gradients accumulate source by source, so only one source's graph is alive at a time.
    loss_u = _weighted_step(cfg, models.u, models.u_optimizer, tokenizer, batches, w, None)
    loss_theta = _weighted_step(
        cfg, models.theta, models.theta_optimizer, tokenizer, batches, s.penalty * w, validation
    )
    state["logits"] = weight_update(
        logits, loss_theta[:-1], loss_u[:-1], s.penalty, s.weight_lr
    ).tolist()
    new = softmax(np.asarray(state["logits"]))
    record: dict[str, Any] = {
        "generation": step,
        "validation_loss": float(loss_theta[-1]),
        "train_loss_theta": float(w @ loss_theta[:-1]),
        "train_loss_u": float(w @ loss_u[:-1]),
        "seconds": round(time.perf_counter() - start, 4),
    }
    for k, name in enumerate(data.names):
        record[f"weight/{name}"] = float(new[k])
        record[f"loss_theta/{name}"] = float(loss_theta[k])
        record[f"loss_u/{name}"] = float(loss_u[k])
    return record


def _weighted_step(
    cfg: Config,
    model: Any,
    optimizer: LisaOptimizer,
    tokenizer: Any,
    batches: list[tuple[list[Example], list[str]]],
    coefficients: np.ndarray,
    validation: tuple[list[Example], list[str]] | None,
) -> np.ndarray:
    """One LISA-AdamW step on [L_val +] sum_k c_k L_k; returns the losses (K,) [+ L_val]."""
    optimizer.zero_grad()
    losses = []
    parts = [*batches, validation] if validation is not None else batches
    for k, (examples, prompts) in enumerate(parts):
        loss = _sft_loss(model, tokenizer, examples, prompts, cfg)
        weight = float(coefficients[k]) if k < len(batches) else 1.0
        (weight * loss).backward()
        losses.append(float(loss.detach()))
    if validation is None:
        losses.append(float("nan"))  # keeps both results (K + 1,)
    if cfg.scalebio.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(optimizer.trainable(), cfg.scalebio.max_grad_norm)
    optimizer.step()
    return np.asarray(losses)


def _initial_state(
    cfg: Config, h: Harness, models: _Models, tokenizer: Any, data: _Data
) -> dict[str, Any]:
    """Uniform source weights; metrics.jsonl's baseline record: the base model's held-out score."""
    baseline = grpo.heldout_accuracy(
        models.policy, tokenizer, data.heldout, cfg, h, "held-out baseline", -1
    )
    weights = {f"weight/{name}": 1.0 / len(data.names) for name in data.names}
    h.log({"generation": -1, "event": "baseline", "heldout_accuracy": baseline, **weights})
    logits = [0.0] * len(data.names)
    return {"step": 0, "baseline_accuracy": baseline, "elapsed": 0.0, "logits": logits}


# ---------------------------------------------------------------------------------------------
# Checkpoint, summary


def _save_checkpoint(run_dir: Path, models: _Models, state: dict[str, Any]) -> None:
    """RUN_DIR/checkpoint/: state.json (logits, LISA steps) and both models' weights and moments.

    Replaced atomically; on a failed write the previous checkpoint stays (StorageError).
    """
    from safetensors.torch import save_file

    from essa.faults import checkpoint_fault

    tensors: dict[str, torch.Tensor] = {}
    extra: dict[str, Any] = {}
    for prefix, model, optimizer in models.parts():
        adam_steps = []
        for i, param in enumerate(model.parameters()):
            tensors[f"{prefix}.param.{i}"] = param.detach().cpu().contiguous()
            moments = optimizer.state.get(param, {})
            if moments:
                tensors[f"{prefix}.exp_avg.{i}"] = moments["exp_avg"].cpu().contiguous()
                tensors[f"{prefix}.exp_avg_sq.{i}"] = moments["exp_avg_sq"].cpu().contiguous()
            adam_steps.append(float(moments["step"]) if moments else 0.0)
        extra[f"{prefix}_adam_steps"] = adam_steps
        extra[f"{prefix}_lisa_steps"] = optimizer.steps
    fault = checkpoint_fault(state["step"])  # None unless ESSA_FAULT is set (tests)
    try:
        with atomic_dir(run_dir / "checkpoint") as tmp:
            save_file(tensors, str(tmp / "tensors.safetensors"))
            (tmp / "state.json").write_text(json.dumps({**state, **extra}))
            if fault is not None:
                fault()
    except OSError as err:
        raise storage_error(run_dir / "checkpoint", err) from None


def _load_checkpoint(run_dir: Path, models: _Models) -> dict[str, Any] | None:
    from safetensors.torch import load_file

    path = run_dir / "checkpoint"
    recover(path)
    if not (path / "state.json").exists():
        return None
    state = json.loads((path / "state.json").read_text())
    tensors = load_file(str(path / "tensors.safetensors"))
    for prefix, model, optimizer in models.parts():
        params = list(model.parameters())
        adam_steps = state.pop(f"{prefix}_adam_steps")
        if len(adam_steps) != len(params):
            raise UserError(f"--resume {run_dir}: the checkpoint does not match this model")
        optimizer.restore(state.pop(f"{prefix}_lisa_steps"))  # that interval's blocks first
        with torch.no_grad():
            for i, param in enumerate(params):
                param.copy_(tensors[f"{prefix}.param.{i}"])
                if f"{prefix}.exp_avg.{i}" in tensors:
                    optimizer.state[param] = {
                        "step": torch.tensor(adam_steps[i]),
                        "exp_avg": tensors[f"{prefix}.exp_avg.{i}"].to(param.device),
                        "exp_avg_sq": tensors[f"{prefix}.exp_avg_sq.{i}"].to(param.device),
                    }
    return state


def _finish(
    cfg: Config,
    h: Harness,
    models: _Models,
    tokenizer: Any,
    data: _Data,
    state: dict[str, Any],
) -> dict[str, Any]:
    """Evaluate theta on the held-out split, export it with the tokenizer, write the summary."""
    from essa.backends.memory import memory_metrics

    final = grpo.heldout_accuracy(
        models.policy, tokenizer, data.heldout, cfg, h, "final held-out", state["step"], final=True
    )
    model_dir = h.run_dir / "model"
    with h.phase("export"), atomic_dir(model_dir) as tmp:
        models.theta.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
    weights = softmax(np.asarray(state["logits"], dtype=np.float64))
    summary = h.summary(
        baseline=state["baseline_accuracy"],
        final=final,
        steps=state["step"],
        adapter_dir=model_dir,
        algorithm="scalebio",
        source_weights={name: float(w) for name, w in zip(data.names, weights, strict=True)},
        source_logits=dict(zip(data.names, state["logits"], strict=True)),
        source_sizes={name: len(v) for name, v in zip(data.names, data.sources, strict=True)},
        selected="final",
        scale_baseline=None,
        scale_baseline_ran=False,
        test_size=len(data.heldout.test),
        scalebio=to_dict(cfg.scalebio),
        **memory_metrics(state["model_bytes"]),
    )
    return h.finish(summary)


def _shown(record: dict[str, Any]) -> dict[str, Any]:
    shown = {"val": record["validation_loss"]}
    shown.update(
        {k.removeprefix("weight/"): v for k, v in record.items() if k.startswith("weight/")}
    )
    if "heldout_accuracy" in record:
        shown["held-out"] = record["heldout_accuracy"]
    return shown
