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

(the last is the gradient in a of the penalty through the softmax: essa/gradient/bilevel.py).
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

import time
from pathlib import Path
from typing import Any

import numpy as np

from essa.config import Config, to_dict
from essa.dist import Comm
from essa.gradient import checkpoint
from essa.gradient.bilevel import (
    Mixture,
    Models,
    load_sources,
    softmax,
    weight_update,
    weighted_step,
)
from essa.gradient.heldout import baseline_state, heldout_accuracy
from essa.harness import Harness
from essa.rundir import atomic_dir


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

    h, task = setup.open_run(cfg, run_dir, resume=resume, console=console, comm=comm, gradient=True)
    sources = load_sources(cfg.data, task)  # before the model loads
    with h:
        cfg, model, tokenizer, base_bytes, _ = setup.open_model(cfg, h, task)
        models = Models.build(cfg.scalebio, cfg.run.seed, model)
        data = Mixture.build(cfg.data, task, sources, tokenizer)
        ev = (cfg.generation, cfg.evaluation.micro_batch_size)
        state = checkpoint.load(run_dir, models.trained()) if resume else None
        state = h.restore(state, done=state["step"] if state else 0)
        if state is None:
            weights = {f"weight/{name}": 1.0 / len(data.names) for name in data.names}
            state = baseline_state(models.policy, tokenizer, data.heldout, h, *ev, weights)
            state["logits"] = [0.0] * len(data.names)  # uniform source weights
        h.say(
            f"ScaleBiO over {', '.join(data.names)} (validation {len(task.sft)}): "
            f"LISA {cfg.scalebio.lisa.active_layers} blocks, lambda {cfg.scalebio.penalty}, "
            f"held-out {h.metric_name} baseline {state['baseline_accuracy']:.3f}"
        )
        for step in h.steps(state["step"], show=_shown):
            record = train_step(cfg, models, tokenizer, data, state, step.index)
            if h.due(step.index, cfg.evaluation.every):
                record["heldout_accuracy"] = heldout_accuracy(
                    models.policy, tokenizer, data.heldout, h, *ev, step=step.index
                )
            state.update(step=step.index + 1, elapsed=h.elapsed)
            step.finish(record, lambda: checkpoint.save(run_dir, models.trained(), state))
        state["model_bytes"] = base_bytes
        return _finish(cfg, h, models, tokenizer, data, state)


def train_step(
    cfg: Config, models: Models, tokenizer: Any, data: Mixture, state: dict[str, Any], step: int
) -> dict[str, Any]:
    """The three simultaneous updates of the module docstring; returns the step's record."""
    s = cfg.scalebio
    start = time.perf_counter()
    logits = np.asarray(state["logits"], dtype=np.float64)  # (K,)
    w = softmax(logits)
    batches, validation = data.batches(s.batch_size, cfg.run.seed, step)
    # Gradients accumulate source by source, so only one source's graph is alive at a time.
    loss_u = weighted_step(models.u, models.u_optimizer, tokenizer, batches, w, None, s)
    loss_theta = weighted_step(
        models.theta, models.theta_optimizer, tokenizer, batches, s.penalty * w, validation, s
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


def _finish(
    cfg: Config, h: Harness, models: Models, tokenizer: Any, data: Mixture, state: dict[str, Any]
) -> dict[str, Any]:
    """Evaluate theta on the held-out split, export it with the tokenizer, write the summary."""
    from essa.backends.memory import memory_metrics

    final = heldout_accuracy(
        models.policy, tokenizer, data.heldout, h, cfg.generation,
        cfg.evaluation.micro_batch_size, "final held-out", state["step"], final=True,
    )  # fmt: skip
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
