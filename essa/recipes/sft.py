"""SFT stage: train a LoRA adapter with PEFT on (prompt, solution) pairs.

ESSA needs a trained adapter: its frozen singular vectors come from SFT (ESSA v3 §1.2). The loss
covers the solution tokens and the end-of-sequence token only, never the prompt.

Deviations from the paper: SFT length is counted in optimizer steps rather than epochs, because
the demo runs on a few dozen examples; a cosine schedule with optional warmup is used.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from essa import seeding
from essa.config import AdapterConfig, SFTConfig
from essa.errors import UserError
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


def train_sft(
    peft_model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    prompts: Sequence[str],
    cfg: SFTConfig,
    seed: int,
    progress: Callable[[dict[str, float]], None] | None = None,
) -> list[float]:
    """Run ``cfg.steps`` AdamW steps on mini-batches drawn without replacement per epoch.

    Returns the loss per step; ``progress`` gets each step's loss, lr and tokens/s.
    """
    if not examples:
        raise UserError(
            "data: no examples left for the SFT stage (data.sft_size is 0 or the data is empty)"
        )
    from essa.backends.hf import undo_cpu_weight_packing

    # QLoRA: a 4-bit base that already ran an eval pass under no_grad on CPU must be unpacked,
    # or the first training forward fails (infra.md §4).
    undo_cpu_weight_packing(peft_model)
    device = next(peft_model.parameters()).device
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, _cosine(cfg.steps, cfg.lr_warmup_steps))
    rng = seeding.rng(seed, "sft.batches")
    order: list[int] = []
    losses: list[float] = []
    peft_model.train()
    for _ in range(cfg.steps):
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
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        lr = float(sched.get_last_lr()[0])  # the rate this step used
        sched.step()
        losses.append(loss.item())
        if progress is not None:
            tokens = int(batch["attention_mask"].sum())
            seconds = time.perf_counter() - start
            progress({"loss": losses[-1], "lr": lr, "tokens/s": round(tokens / seconds, 1)})
    peft_model.eval()
    return losses


def _cosine(total: int, warmup: int) -> Any:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))

    return factor


def save_adapter(peft_model: Any, out_dir: Path) -> Path:
    """Save a standard PEFT adapter directory atomically (the old one kept until complete)."""
    from essa.rundir import atomic_dir

    with atomic_dir(out_dir) as tmp:
        peft_model.save_pretrained(str(tmp))
    return out_dir
