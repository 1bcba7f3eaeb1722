"""Build the bundled demo base model: a tiny char-level Qwen2 that adds 2-digit numbers latently.

Run ``python -m essa.data.build_demo [--out DIR] [--seed N]``; the default output is the
package folder ``essa/data/demo/``, which ships as package data. The build takes a few
minutes on 2 CPU cores and needs no download.

Recipe (ESSA re-weights what the base and the SFT adapter already hold; it cannot add a
missing skill, so the rewarded behaviour must be present but suppressed):

1. Pretrain on ``"{a}+{b}={a+b}<eos>"`` from the train pool until the model mostly adds.
2. Corrupt: keep training on the same pool where each sampled answer is, by a fresh coin
   flip, either right or (a little less often) one too high. The adding circuit survives,
   but the model now puts about even mass on ``a+b`` and ``a+b+1``, so greedy decoding
   misses by one on about half of the unseen pairs. The error always points the same way on purpose:
   with a random sign, ``a+b`` would keep the most mass and greedy decoding would stay
   right.

Pretraining never sees the held-out pairs of ``split_pairs()``, nor a further
``NUM_VALIDATION`` train-pool pairs on which the step counts and the corruption rate were
chosen. Held-out accuracy is measured and recorded, never used to choose anything.

Determinism: the build seeds torch and a numpy Generator, turns on
``torch.use_deterministic_algorithms`` and fixes ``NUM_THREADS`` (CPU float reductions
depend on the thread count), so the same seed, torch version and CPU give the same
weights.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from essa.data.arithmetic import prompt_for, split_pairs

DEFAULT_OUT = Path(__file__).resolve().parent / "demo"
NUM_THREADS = 2
NUM_VALIDATION = 500
# <unk> is never produced (unknown characters are dropped, as Qwen2's own tokenizer does) but
# must be named: transformers 5.x otherwise adds Qwen's "<|endoftext|>" as a 25th token.
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]
# One token per character, spelt in GPT-2 byte-level form ("\u0120" is the space). 24 tokens
# in all, a multiple of 8, so the vocabulary needs no padding rows.
CHARACTERS = list("0123456789+-*/=().,\u0120")
# Qwen2's pre-tokenizer pattern, copied so the tokenizer file means the same thing to
# transformers 5.x, which rebuilds any qwen2 tokenizer with this pattern whatever the file says.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

Pair = tuple[int, int]


@dataclass(frozen=True)
class BuildConfig:
    seed: int = 0
    batch_size: int = 64
    pretrain_steps: int = 600  # plain addition, to about 90% on unseen pairs
    pretrain_lr: float = 1e-3
    warmup_steps: int = 50
    corrupt_steps: int = 400  # answers one too high on a fresh coin flip
    corrupt_lr: float = 5e-4
    # Chance that a sampled answer is a+b+1. A shade under half keeps a+b slightly ahead; at
    # exactly 0.5 the +1 answer tends to win greedy decoding (chosen on the validation pairs).
    corrupt_fraction: float = 0.45
    weight_decay: float = 0.01
    eval_batch_size: int = 500


def build_tokenizer():
    """Character tokenizer: every character is one token; decoding concatenates them.

    It is Qwen2's byte-level BPE pipeline with a 24-token vocabulary and no merges, so
    every character stays its own token. A plain character splitter would be simpler, but
    transformers 5.x loads any qwen2 checkpoint's tokenizer as ``Qwen2Tokenizer``, which
    keeps only the vocabulary and merges and swaps in this pipeline; a space token
    spelt " " would then be silently dropped.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()  # concatenates, mapping "\u0120" back to " "
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        padding_side="left",  # batched generation pads on the left
        model_max_length=64,
        clean_up_tokenization_spaces=False,
    )


def check_tokenizer(tokenizer, reloaded) -> None:
    """Both tokenizers encode character by character and decode back to the same text."""
    assert len(reloaded) == len(tokenizer), (len(reloaded), len(tokenizer))
    for text in ["12+34=", "0+0=0", "99+99=198", "(7 - 3) * 2.5, 1/4"]:
        ids = tokenizer(text)["input_ids"]
        assert len(ids) == len(text), (text, ids)
        assert reloaded(text)["input_ids"] == ids, (text, reloaded(text)["input_ids"], ids)
        assert tokenizer.decode(ids) == reloaded.decode(ids) == text, text


def build_model(tokenizer):
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,  # head_dim 64, which vLLM's CPU attention supports
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        do_sample=False,
        max_new_tokens=4,
    )
    return model


def encode_examples(tokenizer, pairs: list[Pair], answers: list[int], width: int):
    """Right-padded ``prompt answer <eos>`` ids with labels on the answer and eos only.

    Returns (input_ids, labels, attention_mask), each (N, width) int64.
    """
    import torch

    pad = tokenizer.pad_token_id
    input_rows, label_rows, mask_rows = [], [], []
    for (a, b), answer in zip(pairs, answers, strict=True):
        prompt_ids = tokenizer(prompt_for(a, b))["input_ids"]
        target_ids = tokenizer(str(answer))["input_ids"] + [tokenizer.eos_token_id]
        padding = width - len(prompt_ids) - len(target_ids)
        input_rows.append(prompt_ids + target_ids + [pad] * padding)
        label_rows.append([-100] * len(prompt_ids) + target_ids + [-100] * padding)
        mask_rows.append([1] * (width - padding) + [0] * padding)
    return torch.tensor(input_rows), torch.tensor(label_rows), torch.tensor(mask_rows)


def train_stage(
    model,
    clean,
    corrupt,
    corrupt_fraction: float,
    steps: int,
    lr: float,
    cfg: BuildConfig,
    rng: np.random.Generator,
) -> list[float]:
    """AdamW with linear warmup and cosine decay on uniformly sampled pairs; returns losses.

    ``clean`` and ``corrupt`` encode the same pairs; each sampled row comes from ``corrupt``
    with probability ``corrupt_fraction``, drawn afresh every time.
    """
    import torch

    input_ids, labels, attention_mask = (torch.stack(t) for t in zip(clean, corrupt, strict=True))
    num_pairs = clean[0].shape[0]  # tensors above are (2, N, T): 0 = clean, 1 = corrupt
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)

    def lr_factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    losses = []
    for _ in range(steps):
        rows = torch.from_numpy(rng.integers(0, num_pairs, size=cfg.batch_size))
        versions = torch.from_numpy(rng.random(cfg.batch_size) < corrupt_fraction).long()
        loss = model(
            input_ids=input_ids[versions, rows],
            attention_mask=attention_mask[versions, rows],
            labels=labels[versions, rows],
        ).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    model.eval()
    return losses


def greedy_answers(model, tokenizer, pairs: list[Pair], batch_size: int = 500) -> list[str]:
    """Greedy completions of ``a+b=`` up to the first eos, special tokens dropped."""
    import torch

    completions: list[str] = []
    for start in range(0, len(pairs), batch_size):
        prompts = [prompt_for(a, b) for a, b in pairs[start : start + batch_size]]
        batch = tokenizer(prompts, return_tensors="pt", padding=True)
        with torch.no_grad():
            output = model.generate(**batch, max_new_tokens=4, do_sample=False)  # (B, T + 4)
        for row in output[:, batch["input_ids"].shape[1] :].tolist():
            if tokenizer.eos_token_id in row:
                row = row[: row.index(tokenizer.eos_token_id)]
            completions.append(tokenizer.decode(row, skip_special_tokens=True))
    return completions


def score_pairs(model, tokenizer, pairs: list[Pair], batch_size: int = 500) -> dict[str, float]:
    """Fractions of greedy answers that are correct, off by exactly one, or anything else."""
    counts = {"correct": 0, "off_by_one": 0, "other": 0}
    for (a, b), text in zip(
        pairs, greedy_answers(model, tokenizer, pairs, batch_size), strict=True
    ):
        value = int(text) if text.isdigit() else None
        if value == a + b:
            counts["correct"] += 1
        elif value is not None and abs(value - (a + b)) == 1:
            counts["off_by_one"] += 1
        else:
            counts["other"] += 1
    return {key: round(count / len(pairs), 4) for key, count in counts.items()}


def save(model, tokenizer, out: Path) -> None:
    """Weights stored as float16 (half the size); config says float32, so 'auto' loads fp32."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    state_dict = {name: tensor.to(torch.float16) for name, tensor in model.state_dict().items()}
    model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # safetensors writes 0600; package data must be readable by every user.
    (out / "model.safetensors").chmod(0o644)
    # transformers 4.x then loads the tokenizer file as written, 5.x rebuilds the same one.
    config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "Qwen2Tokenizer"
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def build(out: Path, cfg: BuildConfig) -> dict:
    import tokenizers
    import torch
    import transformers

    started = time.perf_counter()
    torch.set_num_threads(NUM_THREADS)
    torch.manual_seed(cfg.seed)
    torch.use_deterministic_algorithms(True)
    rng = np.random.default_rng(cfg.seed)

    train_pool, test = split_pairs()
    pretrain_pairs, validation = train_pool[:-NUM_VALIDATION], train_pool[-NUM_VALIDATION:]
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)

    def report(stage: str) -> dict[str, dict[str, float]]:
        scores = {
            "validation": score_pairs(model, tokenizer, validation, cfg.eval_batch_size),
            "held_out": score_pairs(model, tokenizer, test, cfg.eval_batch_size),
        }
        elapsed = time.perf_counter() - started
        print(f"[{elapsed:6.1f}s] {stage}: {json.dumps(scores)}", flush=True)
        return scores

    # Longest row: "99+99=199<eos>" with the corrupted answer, 10 tokens.
    width = 10
    sums = [a + b for a, b in pretrain_pairs]
    clean = encode_examples(tokenizer, pretrain_pairs, sums, width)
    corrupt = encode_examples(tokenizer, pretrain_pairs, [total + 1 for total in sums], width)
    stages = {
        "pretrain": (0.0, cfg.pretrain_steps, cfg.pretrain_lr),
        "corrupt": (cfg.corrupt_fraction, cfg.corrupt_steps, cfg.corrupt_lr),
    }
    losses, scores = {}, {}
    for stage, (fraction, steps, lr) in stages.items():
        losses[stage] = train_stage(model, clean, corrupt, fraction, steps, lr, cfg, rng)
        scores[stage] = report(stage)

    save(model, tokenizer, out)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reloaded_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    check_tokenizer(tokenizer, reloaded_tokenizer)
    after_reload = score_pairs(reloaded, reloaded_tokenizer, test, cfg.eval_batch_size)
    print(f"reloaded (float16 -> float32) held_out: {json.dumps(after_reload)}", flush=True)

    info = {
        "build_config": asdict(cfg),
        "num_threads": NUM_THREADS,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "pretrain_pairs": len(pretrain_pairs),
        "validation_pairs": len(validation),
        "held_out_pairs": len(test),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "final_loss": {stage: round(values[-1], 4) for stage, values in losses.items()},
        "accuracy": {**scores, "reloaded_held_out": after_reload},
        "stored_dtype": "float16",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "numpy": np.__version__,
        },
        "elapsed_seconds": round(time.perf_counter() - started, 1),
    }
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--seed", type=int, default=BuildConfig.seed, help="build seed")
    args = parser.parse_args(argv)
    info = build(args.out, BuildConfig(seed=args.seed))
    print(f"wrote {args.out} in {info['elapsed_seconds']} s")


if __name__ == "__main__":
    main()
