"""Off-task KL: how far the tuned model moved on text the base model would write.

Mean per-token KL(base || tuned), KL(SFT || tuned) and KL(base || SFT), teacher-forced on the
base model's own greedy continuations of fixed off-task prompts (:func:`offtask_prompts`),
over the |y| + 1 next-token distributions from the end of the prompt to the token after the
continuation (docs/drift.md, "Off-task KL").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from essa.config import DataConfig, GenerationConfig
from essa.drift.models import Models, Pair
from essa.types import Example

# General-text prompts for the off-task set, interleaved with built-in arithmetic problems.
# Short, so that prompt + continuation fit a small model's context.
OFFTASK_TEXTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "Once upon a time, there was a",
    "The opposite of hot is",
    "A list of three primary colours:",
    "def add(a, b):",
    "The largest planet in the solar system is",
    "Translate to French: good morning.",
    "The first month of the year is",
    "Photosynthesis is the process by which",
    "My favourite book is",
    "The chemical symbol for gold is",
    "In 1492, Columbus",
    "A haiku about the sea:",
    "import numpy as np",
    "The square root of 81 is",
)


def offtask_prompts(train_source: str, n: int, tokenizer: Any) -> list[str]:
    """``n`` off-task prompts, the same for every run on the same task and tokenizer.

    Round robin over :data:`OFFTASK_TEXTS` (those the tokenizer round-trips: a digits-only
    vocabulary drops letters) and the fixed test splits of the built-in arithmetic tasks other
    than ``train_source``, each in its own order, until ``n`` are taken or all are used.
    """
    from essa.data.loaders import BUILTIN_SOURCES, builtin_examples

    def encodable(text: str) -> bool:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return tokenizer.decode(ids, skip_special_tokens=True) == text

    streams = [[t for t in OFFTASK_TEXTS if encodable(t)]]
    for source in BUILTIN_SOURCES:
        if source != train_source:
            streams.append([e.prompt for e in builtin_examples(source)[1][:n]])
    out: list[str] = []
    for i in range(max((len(s) for s in streams), default=0)):
        out.extend(s[i] for s in streams if i < len(s))
    return out[:n]


def rendered_offtask_prompts(data: DataConfig, n: int, tokenizer: Any) -> list[str]:
    """:func:`offtask_prompts` in ``data``'s template, as the run renders its own prompts."""
    from essa.data.task import render_prompts

    questions = [Example(prompt=t, answer=None) for t in offtask_prompts(data.source, n, tokenizer)]
    return render_prompts(questions, data.template, tokenizer, data.system_prompt)


def token_kl(logp_p: torch.Tensor, logp_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_v p_v (log p_v - log q_v) per position, from log-probs (..., V).

    >>> logp = torch.log_softmax(torch.tensor([[1.0, 2.0, 3.0]]), -1)
    >>> float(token_kl(logp, logp))
    0.0
    """
    return (logp_p.exp() * (logp_p - logp_q)).sum(-1)


def tail_mask(chunk: Sequence[Pair], tail: int) -> torch.Tensor:
    """(B, tail) bool: row i's last ``|c_i| + 1`` columns, the distributions that predict its
    continuation and the token after it (:func:`essa.backends.teacher.tail_log_softmax`)."""
    mask = torch.zeros((len(chunk), tail), dtype=torch.bool)
    for i, (prompt, cont) in enumerate(chunk):
        mask[i, tail - min(len(cont) + 1, len(prompt) + len(cont), tail) :] = True
    return mask


def base_continuations(models: Models, prompts: Sequence[str], tokens: int) -> list[str]:
    """The base model's greedy continuations of ``prompts``, ``tokens`` new tokens at most."""
    gen = GenerationConfig(max_new_tokens=tokens, temperature=0.0)
    return models.generate(prompts, gen, ["base"])["base"]


ContinuationKey = tuple[int, tuple[str, ...], int, int]  # (id(model), prompts, tokens, batch)


@dataclass
class ContinuationCache:
    """:func:`base_continuations`, generated once per run and reused by every later pass.

    The base model does not train, so each held-out pass would write the same greedy text
    again. An entry holds for the same base model object, prompts, token count and micro-batch
    size (the batch shapes set the matmuls' rounding, which greedy decoding can see); any
    other setting generates afresh. The entry keeps its model, so its ``id`` is not reused.
    """

    entries: dict[ContinuationKey, tuple[Any, list[str]]] = field(default_factory=dict)
    # Texts of the models the search does not move (the base and the SFT adapter): retention's
    # greedy answers and forced-choice scores, written once per run (essa.drift.report.warm) and
    # read by the final report.
    texts: dict[tuple[Any, ...], tuple[Any, list[Any]]] = field(default_factory=dict)

    def continuations(self, models: Models, prompts: Sequence[str], tokens: int) -> list[str]:
        key = (id(models.model), tuple(prompts), tokens, models.micro_batch_size)
        held = self.entries.get(key)
        if held is not None and held[0] is models.model:
            return list(held[1])
        texts = base_continuations(models, prompts, tokens)
        self.entries[key] = (models.model, list(texts))
        return texts

    def fixed_texts(
        self, models: Models, key: tuple[Any, ...], names: Sequence[str], make: Any
    ) -> dict[str, list[Any]]:
        """The texts (or per-item scores) of ``names`` (models the run does not train) under
        ``key``: held ones from the cache, the others from ``make(missing names)``, then held.
        The same rule as the continuations: the same model object and micro-batch size, or
        made afresh."""
        out: dict[str, list[Any]] = {}
        for name in names:
            held = self.texts.get((id(models.model), models.micro_batch_size, name, *key))
            if held is not None and held[0] is models.model:
                out[name] = list(held[1])
        missing = [n for n in names if n not in out]
        if missing:
            made = make(missing)
            for name in missing:
                entry = (id(models.model), models.micro_batch_size, name, *key)
                self.texts[entry] = (models.model, list(made[name]))
                out[name] = made[name]
        return out


@torch.no_grad()
def offtask_kl(
    models: Models,
    prompts: Sequence[str],
    tokens: int,
    micro_batch_size: int,
    cache: ContinuationCache | None = None,
) -> dict[str, Any]:
    """Mean per-token KL between the models on the base model's greedy continuations of
    ``prompts`` (``tokens`` new tokens at most; from ``cache`` when given): ``kl_base`` =
    KL(base || tuned), ``kl_sft`` = KL(SFT || tuned), ``kl_base_sft`` = KL(base || SFT), where
    the models are known."""
    from essa.backends.teacher import encode_pairs

    if cache is None:
        continuations = base_continuations(models, prompts, tokens)
    else:
        continuations = cache.continuations(models, prompts, tokens)
    pairs = encode_pairs(models.tokenizer, prompts, continuations)
    wanted = {
        "kl_base": ("base", "tuned"),
        "kl_sft": ("sft", "tuned"),
        "kl_base_sft": ("base", "sft"),
    }
    wanted = {k: v for k, v in wanted.items() if set(v) <= set(models.names)}
    rows: dict[str, list[float]] = {k: [] for k in wanted}  # per prompt: the KL summed
    counts: list[int] = []  # per prompt: its positions
    for start in range(0, len(pairs), micro_batch_size):
        chunk = pairs[start : start + micro_batch_size]
        logps = models.log_softmax(chunk)  # name -> (B, tail, V)
        mask = tail_mask(chunk, next(iter(logps.values())).shape[1])  # (B, tail)
        counts.extend(mask.sum(1).tolist())
        for key, (p, q) in wanted.items():
            kl = token_kl(logps[p], logps[q]).double() * mask  # (B, tail)
            rows[key].extend(kl.sum(1).tolist())
    positions = sum(counts)
    report: dict[str, Any] = {
        k: sum(v) / positions if positions else math.nan for k, v in rows.items()
    }
    report.update(kl_prompts=len(pairs), kl_positions=positions)
    # Per prompt, its mean per-token KL: two runs on the same base and prompts compare pairwise.
    report["kl_per_prompt"] = {k: [float(f"{s / n:.6g}") for s, n in zip(v, counts, strict=True)]
                               for k, v in rows.items()}  # fmt: skip
    return report
