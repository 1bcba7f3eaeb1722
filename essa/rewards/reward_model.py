"""``reward_model``: a Hugging Face sequence-classification model scoring (prompt, completion).

torch and transformers are imported inside :func:`reward_model` only, so ``import essa.rewards``
stays light; the model loads when the reward is built (``get_reward``), so a bad path fails at
setup rather than mid-run.
"""

from __future__ import annotations

import inspect
from typing import Any

from essa.rewards.base import RewardStats, ScoreFn

INPUT_FORMATS = ("pair", "concat")
OUTPUTS = ("logit", "probability")


def reward_model(
    stats: RewardStats,
    *,
    model: str,
    tokenizer: str | None = None,
    batch_size: int = 8,
    device: str | None = None,
    dtype: str = "auto",
    max_length: int | None = None,
    input_format: str = "pair",
    label_index: int | None = None,
    output: str = "logit",
) -> ScoreFn:
    """Score each (prompt, completion) with ``AutoModelForSequenceClassification``, batched.

    ``R_i = z_i[label]`` (``output="logit"``) or its probability (``output="probability"``:
    ``sigmoid(z_i[0])`` for a one-label model, ``softmax(z_i)[label]`` otherwise), where
    ``z_i = model(tokenize(prompt_i, completion_i)).logits``. A one-label model (the usual
    Bradley-Terry reward model) uses label 0; a multi-label model needs ``label_index``. Never
    None; labels (``answers``) are ignored.

    Args:
        model: local directory or hub id of the classifier.
        tokenizer: its tokenizer, default the same as ``model``. A tokenizer without a pad
            token pads with its EOS token.
        batch_size: sequences per forward; items are sorted by length to limit padding.
        device: ``"cuda"`` when available, else ``"cpu"``, unless given.
        dtype: ``"auto"`` (the checkpoint's), ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        max_length: truncate inputs to this many tokens (``longest_first`` for pairs).
        input_format: ``"pair"`` encodes ``tokenizer(prompt, completion)`` as a text pair (with
            the model's separator tokens); ``"concat"`` encodes ``prompt + completion``, the
            exact text the policy saw (prompts are already rendered by a template).
    """
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if input_format not in INPUT_FORMATS:
        raise ValueError(
            f"unknown input_format {input_format!r}; known: {', '.join(INPUT_FORMATS)}"
        )
    if output not in OUTPUTS:
        raise ValueError(f"unknown output {output!r}; known: {', '.join(OUTPUTS)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype != "auto" and dtype not in dtypes:
        raise ValueError(f"unknown dtype {dtype!r}; known: auto, {', '.join(dtypes)}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tok = AutoTokenizer.from_pretrained(tokenizer or model)
    net = AutoModelForSequenceClassification.from_pretrained(
        model, dtype=dtypes.get(dtype, "auto")
    ).to(device)
    net.eval()
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer of {model!r} has neither a pad nor an EOS token")
        tok.pad_token = tok.eos_token
    if net.config.pad_token_id is None:  # decoder classifiers find the last non-pad token
        net.config.pad_token_id = tok.pad_token_id
    label = _label(net.config.num_labels, label_index)
    accepted = set(inspect.signature(net.forward).parameters)

    def encode(prompts: list[str], completions: list[str]) -> Any:
        options: dict[str, Any] = {"padding": True, "return_tensors": "pt"}
        if max_length is not None:
            options.update(truncation=True, max_length=max_length)
        if input_format == "pair":
            return tok(prompts, completions, **options)
        return tok([p + c for p, c in zip(prompts, completions, strict=True)], **options)

    @torch.inference_mode()
    def score(
        completions: list[str], answers: list[str | None], prompts: list[str]
    ) -> list[float | None]:
        order = sorted(range(len(completions)), key=lambda i: len(prompts[i] + completions[i]))
        scores: list[float | None] = [None] * len(completions)
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            encoded = encode([prompts[i] for i in batch], [completions[i] for i in batch])
            inputs = {k: v.to(device) for k, v in encoded.items() if k in accepted}
            logits = net(**inputs).logits.float()  # (B, num_labels)
            if output == "probability":
                logits = logits.sigmoid() if logits.shape[-1] == 1 else logits.softmax(-1)
            for i, value in zip(batch, logits[:, label].tolist(), strict=True):
                scores[i] = value
        return scores

    return score


def _label(num_labels: int, label_index: int | None) -> int:
    if label_index is None:
        if num_labels != 1:
            raise ValueError(
                f"the reward model has {num_labels} labels: set label_index (0..{num_labels - 1})"
            )
        return 0
    if not 0 <= label_index < num_labels:
        raise ValueError(f"label_index {label_index} out of range for {num_labels} labels")
    return label_index
