"""Gradient LISA: AdamW on the embedding, the head and gamma sampled decoder blocks at a time.

Pan et al., "LISA: Layerwise Importance Sampling for Memory-Efficient LLM Fine-Tuning"
(arXiv 2403.17919), Alg. 1: every K steps freeze all blocks, unfreeze gamma blocks sampled
uniformly without replacement, keep the embedding and the head trainable, run AdamW.

``LisaOptimizer`` owns its AdamW, so the pitfalls of the reference implementation (LMFlow's
``DynamicLayerActivationCallback``; infra.md §1.3) cannot occur:
* at each switch the optimizer state of the deactivated blocks is deleted and the active-body
  parameter group is replaced, so optimizer memory stays at E+H + gamma blocks instead of
  creeping towards full AdamW;
* the optimizer exists before any freezing and is rebuilt per switch, so no sampled block is
  left out of it;
* the layer choice is ``essa.optimizers.layerwise.active_layers(seed, interval_index, ...)``, a
  pure function: every rank and every resumed run agrees; no global RNG;
* the block list is found structurally (the longest ``nn.ModuleList`` of identical modules), with
  no per-architecture attribute map.

Deviations and project choices:
* a block sampled again in the next interval keeps its AdamW moments (only deactivated blocks
  lose theirs); the paper ran each interval as a fresh run;
* parameters outside the blocks other than the embedding and the head (the final norm) are
  always trainable, like E+H; tied embedding/head weights are one tensor, trainable when either
  ``train_embeddings`` or ``train_head`` is on, and counted once;
* the learning rate is set on every group by ``set_lr`` (a torch LR scheduler would miss the
  groups added at switches).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from essa import seeding
from essa.config import DataConfig, LisaConfig, SFTConfig
from essa.errors import UserError
from essa.optimizers.layerwise import active_layers
from essa.types import Example

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from essa.data.task import Task


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks: the longest ModuleList whose entries are all of one class."""
    best: nn.ModuleList | None = None
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 1:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        if best is None or len(module) > len(best):
            best = module
    if best is None:
        raise UserError("trainable: lisa needs a model with a list of decoder layers")
    return best


def _unique(params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def persistent_params(
    model: PreTrainedModel, layers: nn.ModuleList, *, train_embeddings: bool, train_head: bool
) -> list[nn.Parameter]:
    """Parameters trained in every interval: embedding, head (tied: once), other non-block ones."""
    body = {id(p) for p in layers.parameters()}
    embed = list(model.get_input_embeddings().parameters())
    head_module = model.get_output_embeddings()
    head = [] if head_module is None else list(head_module.parameters())
    embed_ids = {id(p) for p in embed + head}
    # Tied weights are one tensor in both lists: trainable when either flag is on.
    chosen = (embed if train_embeddings else []) + (head if train_head else [])
    others = [p for p in model.parameters() if id(p) not in body and id(p) not in embed_ids]
    return _unique(chosen + others)


def tensor_bytes(tensors: Iterable[object]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer state (AdamW: exp_avg, exp_avg_sq, step)."""
    return sum(tensor_bytes(state.values()) for state in optimizer.state.values())


def grad_bytes(model: nn.Module) -> int:
    return tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)


class LisaOptimizer:
    """AdamW over E+H (persistent group) and gamma sampled blocks (replaced every K steps)."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        active_layers: int,  # gamma
        interval: int,  # K optimizer steps per interval
        seed: int,  # the layer schedule's seed
        lr: float,
        weight_decay: float = 0.0,
        train_embeddings: bool = True,
        train_head: bool = True,
        weights: Sequence[float] | None = None,  # layer sampling weights (uniform when None)
        config_key: str = "sft.lisa",  # named in error messages
    ) -> None:
        self.layers = decoder_layers(model)
        if not 1 <= active_layers <= len(self.layers):
            raise UserError(
                f"{config_key}.active_layers: must be in 1..{len(self.layers)} (the model's "
                f"layers), got {active_layers}"
            )
        self.gamma, self.interval, self.seed = active_layers, interval, seed
        self.weights = weights
        self.persistent = persistent_params(
            model, self.layers, train_embeddings=train_embeddings, train_head=train_head
        )
        for p in model.parameters():
            p.requires_grad_(False)
        for p in self.persistent:
            p.requires_grad_(True)
        group = {"params": self.persistent, "name": "persistent"}
        self.optimizer = torch.optim.AdamW([group], lr=lr, weight_decay=weight_decay)
        self.steps = 0
        self.active: tuple[int, ...] = ()
        self.switch(0)

    def switch(self, interval_index: int) -> None:
        """Activate interval ``interval_index``'s blocks; drop the state of the deactivated."""
        new = active_layers(self.seed, interval_index, len(self.layers), self.gamma, self.weights)
        for i in set(self.active) - set(new):
            for p in self.layers[i].parameters():
                self.optimizer.state.pop(p, None)  # the memory LMFlow never frees
                p.requires_grad_(False)
                p.grad = None
        del self.optimizer.param_groups[1:]
        params = [p for i in new for p in self.layers[i].parameters()]
        for p in params:
            p.requires_grad_(True)
        # The persistent group's lr is the scheduled one (set_lr or a recipe's own schedule).
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.add_param_group({"params": params, "lr": lr, "name": "body"})
        self.active = new

    def restore(self, steps: int) -> None:
        """Resume after ``steps`` optimizer steps: activate that interval's blocks."""
        self.steps = steps
        self.switch(steps // self.interval)

    @property
    def state(self) -> Any:
        """The AdamW state (a torch optimizer's ``state``), for checkpoints."""
        return self.optimizer.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def trainable(self) -> list[nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """One AdamW step; after every K-th, switch to the next interval's blocks."""
        self.optimizer.step()
        self.steps += 1
        if self.steps % self.interval == 0:
            self.switch(self.steps // self.interval)


def train_sft_lisa(
    model: PreTrainedModel,
    tokenizer: Any,
    examples: Sequence[Example],
    prompts: Sequence[str],
    cfg: SFTConfig,
    seed: int,
) -> list[float]:
    """``essa.gradient.sft.train_sft`` with the base weights trained by LISA; losses per step."""
    from essa.gradient.schedule import clip_gradients, lr_factor
    from essa.gradient.sft import encode_sft_batch

    if not examples:
        raise UserError("data: no examples left for the SFT stage (data.sft_size is 0)")
    lisa = lisa_optimizer(model, cfg.lisa, seed, cfg.lr, cfg.weight_decay, "sft.lisa")
    device = next(model.parameters()).device
    rng = seeding.rng(seed, "sft.batches")
    order: list[int] = []
    losses: list[float] = []
    model.train()
    for step in range(cfg.steps):
        lisa.set_lr(cfg.lr * lr_factor(step, cfg.steps, cfg.lr_warmup_steps))
        if len(order) < cfg.batch_size:
            order.extend(rng.permutation(len(examples)).tolist())
        idx, order = order[: cfg.batch_size], order[cfg.batch_size :]
        batch = encode_sft_batch(
            tokenizer, [examples[i] for i in idx], [prompts[i] for i in idx], cfg.max_length
        )
        loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
        lisa.zero_grad()
        loss.backward()
        clip_gradients(lisa.trainable(), 1.0)
        lisa.step()
        losses.append(loss.item())
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return losses


def train_base_model(
    sft: SFTConfig,
    data: DataConfig,
    seed: int,
    model: PreTrainedModel,
    tokenizer: Any,
    task: Task,
    run_dir: Path,
) -> tuple[Path, list[float]]:
    """``essa sft`` with ``sft.trainable`` full or lisa: train the base weights, save the model.

    Returns (the saved model directory, losses). Full fine-tuning is ``train_sft`` with every
    parameter trainable (plain AdamW over all of them).
    """
    from essa.data.task import render_prompts
    from essa.gradient.sft import train_sft
    from essa.rundir import atomic_dir

    prompts = render_prompts(task.sft, data.template, tokenizer, data.system_prompt)
    if sft.trainable == "lisa":
        losses = train_sft_lisa(model, tokenizer, task.sft, prompts, sft, seed)
    else:
        for p in model.parameters():
            p.requires_grad_(True)
        losses = train_sft(model, tokenizer, task.sft, prompts, sft, seed)
    out = run_dir / "sft_model"
    with atomic_dir(out) as tmp:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
    return out, losses


def lisa_optimizer(
    model: Any, lisa: LisaConfig, seed: int, lr: float, weight_decay: float, key: str
) -> LisaOptimizer:
    """:class:`LisaOptimizer` on ``model`` with the ``lisa`` section's layer schedule."""
    return LisaOptimizer(
        model,
        active_layers=lisa.active_layers,
        interval=lisa.interval,
        seed=seed,
        lr=lr,
        weight_decay=weight_decay,
        train_embeddings=lisa.train_embeddings,
        train_head=lisa.train_head,
        config_key=key,
    )
