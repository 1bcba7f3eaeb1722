"""Preference pairs (from a file, or sampled online) and DPO's loss (Rafailov et al., arXiv 2305.18290; docs/dpo-scalebio.md).

Sequence log-probs are sums over the completion tokens up to and including EOS (as TRL), on
untempered logits; label smoothing is cDPO's (Mitchell 2023).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from essa import seeding
from essa.config import DPOConfig
from essa.gradient.data import TaskData, draw
from essa.gradient.policy import Policy, Rollout, Sampling, rollout, select, token_logprobs
from essa.rewards.base import Reward, score
from essa.types import PreferencePair

if TYPE_CHECKING:
    from essa.harness import Phase


class DPOLoss(NamedTuple):
    loss: torch.Tensor  # () mean over pairs
    chosen_rewards: torch.Tensor  # (N,) beta * (log pi - log ref) of the chosen, detached
    rejected_rewards: torch.Tensor  # (N,)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    d: DPOConfig,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> DPOLoss:
    """DPO's loss from sequence log-probs, each (N,); token counts (N,) are IPO's normaliser.

    sigmoid: -(1 - eps) log sig(beta * delta) - eps log sig(-beta * delta), with
    delta = (pi_c - ref_c) - (pi_r - ref_r); ipo: (delta_per_token - 1 / (2 beta))^2.
    """
    chosen_ratio = policy_chosen - ref_chosen  # (N,)
    rejected_ratio = policy_rejected - ref_rejected  # (N,)
    if d.loss == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("ipo needs the completions' token counts")
        delta = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(
            min=1
        )
        per_pair = (delta - 1.0 / (2.0 * d.beta)) ** 2
    else:
        logits = d.beta * (chosen_ratio - rejected_ratio)
        eps = d.label_smoothing
        per_pair = -(1.0 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)
    return DPOLoss(
        per_pair.mean(), d.beta * chosen_ratio.detach(), d.beta * rejected_ratio.detach()
    )


def sequence_logprobs(model: Any, batch: Rollout) -> torch.Tensor:
    """Sum of the completion tokens' log-probs per row (up to and including EOS): (B,)."""
    t = batch.completion_ids.shape[1]
    logp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, t, 1.0)  # (B, T)
    return (logp * batch.mask).sum(-1)


def encode_pairs(
    tokenizer: Any, prompts: Sequence[str], chosen: Sequence[str], rejected: Sequence[str]
) -> Rollout:
    """Rows [prompt + chosen + EOS]... then [prompt + rejected + EOS]..., in Rollout's layout."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts] * 2
    completions = [
        tokenizer(c, add_special_tokens=False)["input_ids"] + [eos] for c in [*chosen, *rejected]
    ]
    p = max(len(x) for x in prompt_ids)
    t = max(len(x) for x in completions)
    input_ids, attention, completion_ids, mask = [], [], [], []
    for prompt, completion in zip(prompt_ids, completions, strict=True):
        left, right = p - len(prompt), t - len(completion)
        input_ids.append([pad] * left + prompt + completion + [pad] * right)
        attention.append([0] * left + [1] * (len(prompt) + len(completion)) + [0] * right)
        completion_ids.append(completion + [pad] * right)
        mask.append([1.0] * len(completion) + [0.0] * right)
    return Rollout(
        input_ids=torch.tensor(input_ids),  # (2n, P + T)
        attention_mask=torch.tensor(attention),  # (2n, P + T)
        completion_ids=torch.tensor(completion_ids),  # (2n, T)
        mask=torch.tensor(mask),  # (2n, T)
        truncated=torch.zeros(len(completions), dtype=torch.bool),
        texts=[*chosen, *rejected],
    )


def pick_pairs(rewards: np.ndarray) -> list[tuple[int, int, int]]:
    """(prompt, chosen, rejected) per prompt of ``rewards`` (N, k) whose samples differ.

    Chosen: the first sample of the highest reward; rejected: the first of the lowest. NaN
    (an ungradable sample) is never picked; a prompt with fewer than two graded samples or
    with all rewards equal gives no pair.
    """
    out = []
    for i, row in enumerate(rewards):
        graded = np.flatnonzero(~np.isnan(row))
        if graded.size < 2:
            continue
        values = row[graded]
        best, worst = graded[int(np.argmax(values))], graded[int(np.argmin(values))]
        if row[best] > row[worst]:
            out.append((i, int(best), int(worst)))
    return out


def file_batch(
    pairs: Sequence[PreferencePair],
    prompts: Sequence[str],
    tokenizer: Any,
    d: DPOConfig,
    seed: int,
    step: int,
) -> tuple[Rollout, dict[str, Any]]:
    """The step's pairs from the file: a draw without replacement seeded by (seed, step)."""
    idx = draw(len(pairs), d.pairs_per_step, seed, "dpo.file_pairs", step)
    chosen = [pairs[i].chosen for i in idx]
    rejected = [pairs[i].rejected for i in idx]
    rows = [prompts[i] for i in idx]
    return encode_pairs(tokenizer, rows, chosen, rejected), {"pairs": len(idx)}


def online_batch(
    d: DPOConfig,
    sampling: Sampling,
    seed: int,
    policy: Policy,
    tokenizer: Any,
    reward: Reward,
    data: TaskData,
    step: int,
    round_bar: Callable[[int], Phase],
) -> tuple[Rollout | None, dict[str, Any]]:
    """Sample k completions of the step's prompts, score, pair best with worst per prompt (the
    common RLVR-to-DPO recipe; rows: the n chosen, then their n rejected)."""
    k = d.samples_per_prompt
    idx = draw(len(data.train), d.pairs_per_step, seed, "dpo.prompts", step)
    prompts = [data.train_prompts[i] for i in idx for _ in range(k)]
    answers = [data.train[i].answer for i in idx for _ in range(k)]
    with round_bar(len(prompts)) as bar:
        out = rollout(
            policy, tokenizer, prompts, sampling, seeding.seed_int(seed, "dpo.sampling", step),
            progress=bar.advance,
        )  # fmt: skip
    keys = [(seed, step, i, j) for i in range(len(idx)) for j in range(k)]
    scores = score(reward, out.texts, answers, prompts, keys)
    rewards = np.array([math.nan if s is None else float(s) for s in scores]).reshape(-1, k)
    chosen = pick_pairs(rewards)  # (N, k) -> pairs
    stats = {
        "pairs": len(chosen),
        "mean_reward": float(np.nanmean(rewards)) if np.isfinite(rewards).any() else math.nan,
        "new_tokens": int((out.completion_ids != tokenizer.pad_token_id).sum()),
    }
    if not chosen:
        return None, stats
    rows = [i * k + c for i, c, _ in chosen] + [i * k + r for i, _, r in chosen]
    return select(out, torch.tensor(rows)), stats
