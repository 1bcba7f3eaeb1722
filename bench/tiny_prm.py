"""A tiny process-reward model for the demo task, trained in-process (no PRM weights download).

    python -m bench.tiny_prm OUT_DIR [--steps 400]

A Qwen2 token classifier, the demo model's body with a new two-label head, trained to tell a
right sum from the demo model's typical error (one too high or one too low) at the answer's last
token, on the demo's *training* pool only (held-out items never reach it). On the demo a
completion is one step, so this PRM is a learned verifier; it reads each step's last token like
any token-classification PRM (essa/rewards/prm_model.py). Its accuracy on 1000 unseen training
-pool items is written to OUT_DIR/prm_stats.json, so a user sees how good the PRM is: on this
machine it stays at chance (see train_demo_prm), so bench.signal reports no PRM row from it.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

DEMO = Path(__file__).resolve().parent.parent / "essa" / "data" / "demo"


def labelled(prompts_answers: list[tuple[str, str]], rng: random.Random) -> list[tuple[str, int]]:
    """``prompt + answer`` right (label 1) or off by one (label 0), half each."""
    out = []
    for prompt, answer in prompts_answers:
        right = rng.random() < 0.5
        value = int(answer) + (0 if right else rng.choice((-1, 1)))
        out.append((prompt + str(value), int(right)))
    return out


def train_demo_prm(out: Path, steps: int = 400, seed: int = 0, lr: float = 1e-3) -> dict[str, Any]:
    """Train and save the PRM under ``out``; its held-back accuracy and final loss."""
    import torch
    import transformers

    from essa.data.arithmetic import arithmetic_examples

    train, _ = arithmetic_examples()  # the training pool only
    items = [(e.prompt, e.answer) for e in train]
    rng = random.Random(seed)
    rng.shuffle(items)
    held_back, pool = items[:1000], items[1000:]
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEMO)
    torch.manual_seed(seed)
    # Initialised from the demo model's own body (PRMs are fine-tuned LMs). Measured: it stays
    # at chance (loss 0.69, held-back accuracy 0.50 after 300 steps at lr 1e-4 or 1e-3), as
    # did a randomly initialised 2-layer classifier after 400 steps at 3e-3: the demo body was
    # built to be torn between the right sum and the one off by one, so it carries no verifier
    # signal, and a from-scratch one needs far more steps than a bench can spend here.
    model = transformers.AutoModelForTokenClassification.from_pretrained(DEMO, num_labels=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        batch_items = labelled(rng.sample(pool, 64), rng)
        batch, labels = _batch(tokenizer, batch_items)
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % 100 == 0:
            print(
                f"[tiny_prm] step {step + 1}/{steps}: loss {float(loss.detach()):.3f}", flush=True
            )
    model.eval()
    test_items = labelled(held_back, random.Random(seed + 1))
    batch, labels = _batch(tokenizer, test_items)
    with torch.no_grad():
        pred = model(**batch).logits.argmax(-1)  # (B, T)
    at = labels != -100
    accuracy = int((pred[at] == labels[at]).sum()) / int(at.sum())  # exact k / n
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    stats = {"steps": steps, "final_loss": float(loss.detach()), "held_back_accuracy": accuracy,
             "held_back_items": len(test_items), "trained_on": "demo training pool"}  # fmt: skip
    (out / "prm_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    return stats


def _batch(tokenizer: Any, items: list[tuple[str, int]]) -> tuple[dict[str, Any], Any]:
    """Right-padded ids and labels at each text's last token (-100 elsewhere)."""
    import torch

    tokenizer.padding_side = "right"
    batch = tokenizer([t for t, _ in items], padding=True, return_tensors="pt")
    labels = torch.full(batch["input_ids"].shape, -100)  # (B, T)
    last = batch["attention_mask"].sum(-1) - 1  # (B,)
    labels[torch.arange(len(items)), last] = torch.tensor([y for _, y in items])
    return dict(batch), labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    print(json.dumps(train_demo_prm(args.out, args.steps)))


if __name__ == "__main__":
    main()
