"""ScaleBiO's pieces (Pan et al., arXiv 2406.19976; docs/dpo-scalebio.md): the data mixture,
the source-weight update through the softmax and one LISA-AdamW step on a weighted SFT loss."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from essa.config import DataConfig, ScaleBiOConfig
from essa.errors import UserError
from essa.gradient.checkpoint import Trained
from essa.gradient.data import TaskData, draw
from essa.gradient.lisa import lisa_optimizer
from essa.gradient.policy import Policy
from essa.gradient.schedule import clip_gradients
from essa.types import Example

if TYPE_CHECKING:
    from essa.data.task import Task
    from essa.gradient.lisa import LisaOptimizer

Batch = tuple[list[Example], list[str]]  # examples and their rendered prompts


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


def load_sources(data: DataConfig, task: Task) -> dict[str, list[Example]]:
    """Each ``data.sources`` entry's examples, without the test's or validation's questions."""
    from essa.data import DataError, load_examples

    reserved = {e.prompt for e in task.test} | {e.prompt for e in task.sft}
    out: dict[str, list[Example]] = {}
    for name, path in data.sources.items():
        try:
            examples = load_examples(
                path,
                question_field=data.question_field,
                answer_field=data.answer_field,
                solution_field=data.solution_field,
            )
        except DataError as err:
            raise UserError(f"data.sources.{name}: {err}") from None
        kept = [e for e in examples if e.prompt not in reserved]
        if not kept:
            raise UserError(
                f"data.sources.{name}: no example left once the held-out and validation "
                f"questions of {data.source} are removed"
            )
        out[name] = kept
    return out


@dataclass(frozen=True)
class Mixture:
    """The sources (per source: examples, prompts), the validation set and the held-out split."""

    names: list[str]
    sources: list[list[Example]]
    source_prompts: list[list[str]]
    validation: list[Example]
    validation_prompts: list[str]
    heldout: TaskData  # the test split only

    @classmethod
    def build(
        cls, data: DataConfig, task: Task, sources: dict[str, list[Example]], tokenizer: Any
    ) -> Mixture:
        from essa.data.task import render_prompts

        def render(examples: Sequence[Example]) -> list[str]:
            return render_prompts(examples, data.template, tokenizer, data.system_prompt)

        return cls(
            names=list(sources),
            sources=list(sources.values()),
            source_prompts=[render(v) for v in sources.values()],
            validation=task.sft,
            validation_prompts=render(task.sft),
            heldout=TaskData.heldout(task, data, tokenizer),
        )

    def batches(self, size: int, seed: int, step: int) -> tuple[list[Batch], Batch]:
        """The step's draws: ``size`` examples of every source, then of the validation set,
        without replacement, seeded by (seed, step, stream)."""
        out = []
        for k, examples in enumerate(self.sources):
            idx = draw(len(examples), size, seed, "scalebio.batches", step, k)
            out.append(([examples[i] for i in idx], [self.source_prompts[k][i] for i in idx]))
        k = len(self.sources)
        idx = draw(len(self.validation), size, seed, "scalebio.batches", step, k)
        return out, ([self.validation[i] for i in idx], [self.validation_prompts[i] for i in idx])


@dataclass
class Models:
    """theta (the upper-level model, exported) and u (the lower-level solver), each with LISA."""

    theta: Any
    u: Any
    theta_optimizer: LisaOptimizer
    u_optimizer: LisaOptimizer

    @classmethod
    def build(cls, s: ScaleBiOConfig, seed: int, model: Any) -> Models:
        """theta is ``model``, u a deep copy of it."""
        models = [model.eval(), copy.deepcopy(model).eval()]
        # One seed for both: theta and u train the same blocks in an interval.
        optimizers = [
            lisa_optimizer(m, s.lisa, seed, s.lr, s.weight_decay, "scalebio.lisa") for m in models
        ]
        return cls(models[0], models[1], optimizers[0], optimizers[1])

    @property
    def policy(self) -> Policy:
        """theta seen as a policy, for the held-out pass."""
        return Policy(self.theta, list(self.theta.parameters()), [])

    def trained(self) -> list[Trained]:
        missing = "the checkpoint does not match this model"
        return [
            Trained("theta", list(self.theta.parameters()), self.theta_optimizer, missing),
            Trained("u", list(self.u.parameters()), self.u_optimizer, missing),
        ]


def sft_loss(
    model: Any, tokenizer: Any, examples: Sequence[Example], prompts: Sequence[str], length: int
) -> torch.Tensor:
    """Mean token cross-entropy of the solutions (and EOS) given the prompts: ()."""
    from essa.gradient.sft import encode_sft_batch

    batch = encode_sft_batch(tokenizer, examples, prompts, length)
    device = next(model.parameters()).device
    return model(**{k: v.to(device) for k, v in batch.items()}).loss


def weighted_step(
    model: Any,
    optimizer: LisaOptimizer,
    tokenizer: Any,
    batches: list[Batch],
    coefficients: np.ndarray,
    validation: Batch | None,
    s: ScaleBiOConfig,
) -> np.ndarray:
    """One LISA-AdamW step on [L_val +] sum_k c_k L_k; returns the losses (K,) [+ L_val]."""
    optimizer.zero_grad()
    losses = []
    parts = [*batches, validation] if validation is not None else batches
    for k, (examples, prompts) in enumerate(parts):
        loss = sft_loss(model, tokenizer, examples, prompts, s.max_length)
        weight = float(coefficients[k]) if k < len(batches) else 1.0
        (weight * loss).backward()
        losses.append(float(loss.detach()))
    if validation is None:
        losses.append(float("nan"))  # keeps both results (K + 1,)
    if s.max_grad_norm > 0:  # (the norm of a whole model's gradients is not worth a pass)
        clip_gradients(optimizer.trainable(), s.max_grad_norm)
    optimizer.step()
    return np.asarray(losses)
