"""Teacher-forced token log-probs for a whole population in batched forwards (HF backend).

The log-probability rewards (essa.rewards.logprob) need ``log pi_c(y_t | x, y_<t)`` of given
continuations ``y`` (a reference answer, or a completion) under each candidate ``c``. As in
generation, the rows of one forward carry different candidates (PopulationLoRA), so a
population of P candidates costs one LoRA's worth of extra compute per token, not P models.

Layout: rows are ``[pads][prompt][continuation]`` (left padded), so every row's continuation
ends at the last column and the logits of the last ``max |y| + 1`` columns cover all of them
(``logits_to_keep``): the (B, T, V) logits of the prompt positions are never built. Positions
come from the attention mask, as in ``generate``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from essa.adapters import PopulationLoRA, SVDAdapter, candidate_rows
from essa.backends.models import model_device


def encode_pairs(
    tokenizer: Any, prompts: Sequence[str], continuations: Sequence[str]
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, continuation ids) per pair, tokenised separately (no special tokens), so
    that the scored tokens are exactly the continuation's."""
    p_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    c_ids = tokenizer(list(continuations), add_special_tokens=False)["input_ids"]
    return list(zip(p_ids, c_ids, strict=True))


class MarginSink(list):
    """A ``reference_logprobs`` sink (an empty list) that receives each reference token's margin
    to the greedy choice instead of its log-prob: log p(y*_t) - max_v log p(v) at the same
    position, <= 0, and 0 exactly where greedy decoding after y*_<t would write y*_t.

    Their mean over a reference is 0 when greedy decoding writes the whole reference, and says
    how far each position is from flipping to it otherwise: unlike the log-likelihood, sharpening
    a distribution that already puts the reference on top changes nothing
    (``reward.reference_signal: margin``; docs/real-model.md).
    """


def token_scores(logp: torch.Tensor, ids: torch.Tensor, margin: bool) -> torch.Tensor:
    """(B, L): each teacher token's log-prob under ``logp`` (B, L, V), or with ``margin`` its
    log-prob minus the position's largest (:class:`MarginSink`).

    >>> logp = torch.log(torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]]))
    >>> ids = torch.tensor([[1, 1]])
    >>> token_scores(logp, ids, margin=True).exp().round(decimals=3).tolist()
    [[0.6, 1.0]]
    """
    picked = logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (B, L)
    return picked - logp.amax(dim=-1) if margin else picked


@torch.no_grad()
def token_logprobs_rows(
    model: Any,
    pairs: Sequence[tuple[list[int], list[int]]],
    *,
    pad_id: int,
    micro_batch_size: int,
    set_rows: Any = None,
    row_candidates: torch.Tensor | None = None,
    margin: bool = False,
) -> list[list[float]]:
    """Per row, the continuation tokens' log-probs (float32 log-softmax), or with ``margin``
    their margins (:func:`token_scores`); ``[]`` if empty."""
    device = model_device(model)
    keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    out: list[list[float]] = []
    for start in range(0, len(pairs), micro_batch_size):
        chunk = pairs[start : start + micro_batch_size]
        if set_rows is not None and row_candidates is not None:
            set_rows(row_candidates[start : start + len(chunk)])
        out.extend(_chunk_logprobs(model, chunk, pad_id, device, keep, margin))
    return out


def _chunk_logprobs(
    model: Any,
    chunk: Sequence[tuple[list[int], list[int]]],
    pad_id: int,
    device: torch.device,
    keep: bool,
    margin: bool = False,
) -> list[list[float]]:
    logp, ids = tail_log_softmax(model, chunk, pad_id, device, keep)
    logp = logp[:, :-1, :]  # (B, tail - 1, V): predicts ids[-tail+1:]
    target = ids[:, ids.shape[1] - logp.shape[1] :]  # (B, tail - 1)
    picked = token_scores(logp, target, margin).cpu()  # (B, tail - 1)
    out = []
    for i, (_, cont) in enumerate(chunk):
        n = len(cont)
        out.append(picked[i, picked.shape[1] - n :].tolist() if n else [])
    return out


def tail_log_softmax(
    model: Any,
    chunk: Sequence[tuple[list[int], list[int]]],
    pad_id: int,
    device: torch.device,
    keep: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs (float32) at the last ``max |c| + 1`` columns of the left-padded
    rows ``[pads][prompt][continuation]``, and the rows' ids (B, T). Row i's continuation is
    predicted by its last ``|c_i| + 1`` columns minus the very last, which predicts the token
    after it. Returns ((B, tail, V), (B, T))."""
    rows = [p + c for p, c in chunk]
    width = max(len(r) for r in rows)
    tail = max(len(c) for _, c in chunk) + 1  # columns whose logits predict a scored token
    tail = min(tail, width)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.as_tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T): as generate derives them
    extra = {"logits_to_keep": tail} if keep else {}
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, **extra).logits
    logits = logits[:, -tail:, :].float()  # (B, tail, V)
    return torch.log_softmax(logits, dim=-1), ids


def population_token_logprobs(
    model: Any,
    tokenizer: Any,
    adapter: SVDAdapter,
    population: np.ndarray,
    prompts: Sequence[str],
    continuations: Sequence[str],
    *,
    micro_batch_size: int,
) -> list[list[list[float]]]:
    """``out[c][i]``: token log-probs of ``continuations[i]`` after ``prompts[i]`` under
    candidate ``c`` of ``population`` (P, D), on the *base* model (the adapter is applied by
    PopulationLoRA, candidate-major rows)."""
    population = np.atleast_2d(population)
    n = len(prompts)
    if n == 0:
        return [[] for _ in range(len(population))]
    pairs = encode_pairs(tokenizer, prompts, continuations)
    rows = [pair for _ in range(len(population)) for pair in pairs]  # candidate-major
    with PopulationLoRA(model, adapter) as pop:
        pop.set_population(population)
        flat = token_logprobs_rows(
            model,
            rows,
            pad_id=tokenizer.pad_token_id,
            micro_batch_size=micro_batch_size,
            set_rows=pop.set_rows,
            row_candidates=candidate_rows(len(population), n),
        )
    return [flat[c * n : (c + 1) * n] for c in range(len(population))]
