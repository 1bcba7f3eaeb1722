"""SFT stage: train a LoRA adapter with PEFT on (prompt, solution) pairs.

ESSA needs a trained adapter: its frozen singular vectors come from SFT (ESSA v3 §1.2). The loss
covers the solution tokens and the end-of-sequence token only, never the prompt.

Deviations from the paper: SFT length is counted in optimizer steps rather than epochs, because
the demo runs on a few dozen examples; a cosine schedule with optional warmup is used.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from essa import seeding
from essa.config import AdapterConfig, SFTConfig
from essa.errors import UserError
from essa.gradient.schedule import clip_gradients, lr_factor
from essa.types import Example


def make_lora_model(model: Any, cfg: AdapterConfig) -> Any:
    """Wrap ``model`` with a fresh PEFT LoRA on ``cfg.target_modules``."""
    from peft import LoraConfig, get_peft_model

    check_target_modules(model, cfg.target_modules)
    lora = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.lora_alpha,  # type: ignore[arg-type]  # PEFT annotates int; floats work
        target_modules=list(cfg.target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def check_target_modules(model: Any, targets: Sequence[str]) -> None:
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in names]
    if missing:
        raise UserError(f"adapter.target_modules: {missing} not found in the model")


def encode_sft_batch(
    tokenizer: Any, examples: Sequence[Example], prompts: Sequence[str], max_length: int
) -> dict[str, torch.Tensor]:
    """Right-padded input_ids/attention_mask/labels; labels are -100 on prompt and padding."""
    rows, labels = [], []
    for example, prompt in zip(examples, prompts, strict=True):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        t = tokenizer(example.target, add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id
        ]
        ids = (p + t)[:max_length]
        rows.append(ids)
        labels.append(([-100] * len(p) + t)[:max_length])
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])  # (B, T)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])  # (B, T)
    label_t = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])  # (B, T)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": label_t}


@dataclass
class SFTLimit:
    """A budgeted SFT (essa.es.plan): at most ``seconds`` of wall-clock, and a loss check on
    ``check`` (training examples, never held-out ones) every few steps that stops SFT once it
    no longer improves. ``stopped`` says why SFT ended ("steps", "time" or "check")."""

    seconds: float
    check: Sequence[Example]
    check_prompts: Sequence[str]
    checks: int = 6  # loss checks over sft.steps
    patience: int = 2  # checks without improvement before SFT stops
    stopped: str = "steps"
    steps_done: int = 0
    check_losses: list[float] = field(default_factory=list)

    def every(self, steps: int) -> int:
        return max(1, steps // self.checks)

    def improved(self) -> bool:
        """False once the last ``patience`` checks are all above the best one before them."""
        losses = self.check_losses
        if len(losses) <= self.patience:
            return True
        return min(losses[-self.patience :]) < min(losses[: -self.patience])


def train_sft(
    peft_model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    prompts: Sequence[str],
    cfg: SFTConfig,
    seed: int,
    progress: Callable[[dict[str, float]], None] | None = None,
    limit: SFTLimit | None = None,
) -> list[float]:
    """Run ``cfg.steps`` AdamW steps on mini-batches drawn without replacement per epoch.

    Returns the loss per step; ``progress`` gets each step's loss, lr and tokens/s. With
    ``limit``, SFT also stops at its time limit (the cosine schedule's horizon is cut to the
    steps that fit, from the first steps' time, so the rate still decays to zero) or when its
    check loss stops improving.
    """
    if not examples:
        raise UserError(
            "data: no examples left for the SFT stage (data.sft_size is 0 or the data is empty)"
        )
    from essa.backends.models import undo_cpu_weight_packing

    # QLoRA: a 4-bit base that already ran an eval pass under no_grad on CPU must be unpacked,
    # or the first training forward fails (infra.md §4).
    undo_cpu_weight_packing(peft_model)
    device = next(peft_model.parameters()).device
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    horizon = [cfg.steps]  # the schedule's length; a time limit may cut it after two steps
    warmup = cfg.lr_warmup_steps  # read at each step: a time limit may cut the horizon
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda step: lr_factor(step, horizon[0], warmup)
    )
    rng = seeding.rng(seed, "sft.batches")
    order: list[int] = []
    losses: list[float] = []
    step_seconds: list[float] = []
    began = time.perf_counter()
    peft_model.train()
    for step in range(cfg.steps):
        if step >= horizon[0]:
            break
        start = time.perf_counter()
        if len(order) < cfg.batch_size:
            order.extend(rng.permutation(len(examples)).tolist())
        idx, order = order[: cfg.batch_size], order[cfg.batch_size :]
        batch = encode_sft_batch(
            tokenizer, [examples[i] for i in idx], [prompts[i] for i in idx], cfg.max_length
        )
        loss = peft_model(**{k: v.to(device) for k, v in batch.items()}).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        clip_gradients(params, 1.0)
        optim.step()
        lr = float(sched.get_last_lr()[0])  # the rate this step used
        sched.step()
        losses.append(loss.item())
        step_seconds.append(time.perf_counter() - start)
        if progress is not None:
            tokens = int(batch["attention_mask"].sum())
            progress(
                {"loss": losses[-1], "lr": lr, "tokens/s": round(tokens / step_seconds[-1], 1)}
            )
        if limit is not None and _check_limit(
            limit, step, horizon, step_seconds, began, cfg.steps, peft_model, tokenizer, cfg
        ):
            break
    if limit is not None:
        limit.steps_done = len(losses)
    peft_model.eval()
    return losses


def _check_limit(
    limit: SFTLimit,
    step: int,
    horizon: list[int],
    step_seconds: list[float],
    began: float,
    steps: int,
    peft_model: Any,
    tokenizer: Any,
    cfg: SFTConfig,
) -> bool:
    """After ``step``: cut the horizon to the time limit (once two steps are timed) and run the
    loss check when due; True when SFT should stop now because the check stopped improving."""
    if step == 1:
        # The first step pays one-off costs; the second is the steady rate.
        left = limit.seconds - (time.perf_counter() - began)
        fit = step + 1 + int(max(0.0, left) / max(step_seconds[1], 1e-9))
        if fit < horizon[0]:
            horizon[0] = fit
            limit.stopped = "time"
    if step >= 1 and time.perf_counter() - began > limit.seconds and step + 1 < horizon[0]:
        limit.stopped = "time"  # steps grew slower than the first ones: stop at the limit
        return True
    if not limit.check or (step + 1) % limit.every(steps) or step + 1 >= horizon[0]:
        return False
    loss = check_loss(peft_model, tokenizer, limit.check, limit.check_prompts, cfg.max_length)
    limit.check_losses.append(loss)
    peft_model.train()
    if limit.improved():
        return False
    limit.stopped = "check"
    return True


def check_loss(
    peft_model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    prompts: Sequence[str],
    max_length: int,
) -> float:
    """Mean token loss of the targets of ``examples`` (forward only, eval mode)."""
    peft_model.eval()
    batch = encode_sft_batch(tokenizer, examples, prompts, max_length)
    device = next(peft_model.parameters()).device
    with torch.no_grad():
        return float(peft_model(**{k: v.to(device) for k, v in batch.items()}).loss)


def save_adapter(peft_model: Any, out_dir: Path) -> Path:
    """Save a standard PEFT adapter directory atomically (the old one kept until complete)."""
    from essa.rundir import atomic_dir

    with atomic_dir(out_dir) as tmp:
        peft_model.save_pretrained(str(tmp))
    return out_dir
