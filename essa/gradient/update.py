"""The GRPO step's policy update: ``grpo.num_iterations`` AdamW steps on the variant's clipped
surrogate (essa/gradient/losses.py), each accumulated over micro-batches, with the KL to the
frozen SFT adapter and the entropy bonus. Every sum divides by the whole step's counts, so any
split into micro-batches gives the same update.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from essa.config import GRPOConfig
from essa.gradient import losses
from essa.gradient.policy import Policy, Rollout, micro_batches, token_logprobs
from essa.gradient.sampling import temperature_at
from essa.gradient.schedule import clip_gradients

if TYPE_CHECKING:
    from essa.gradient.optim import Optimizer

# rows (b,) of the batch -> (log-probs, token entropies), each (b, T)
Scorer = Callable[[Tensor], tuple[Tensor, Tensor]]


def policy_update(
    g: GRPOConfig,
    variant: losses.Variant,
    policy: Policy,
    optimizer: Optimizer,
    batch: Rollout,
    advantages: Tensor,
    mask: Tensor,
    counts: losses.Counts,
    step: int,
) -> dict[str, float]:
    """``num_iterations`` AdamW steps on the batch; the step's loss metrics (means over it).

    ``advantages``: (B,) or (B, T); ``mask`` (B, T): the loss mask. The loss is the variant's
    surrogate, minus ``grpo.entropy.coef`` times the mean token entropy over every completion
    token of the batch (``batch.mask``, not the loss mask).
    """
    beta = variant.beta if g.beta is None else g.beta
    t = batch.completion_ids.shape[1]
    chunks = micro_batches(policy.model, mask.shape[0], t, g.grad_accumulation)
    temperature = temperature_at(step, g)  # log-probs of the distribution that sampled
    use_bonus = g.entropy.coef != 0.0  # entropies are computed only for the bonus

    def logprobs(rows: Tensor) -> tuple[Tensor, Tensor]:
        ids, attention = batch.input_ids[rows], batch.attention_mask[rows]
        return token_logprobs(
            policy.model, ids, attention, t, temperature, g.entropy.floor, use_bonus
        )

    old_logp, ref_logp = _fixed_logprobs(policy, logprobs, chunks, g.num_iterations, beta)
    surrogate = _Surrogate(
        g, variant, batch, advantages, mask, counts, beta, old_logp, ref_logp, int(batch.mask.sum())
    )
    totals: dict[str, float] = {}
    for _ in range(g.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        totals = {"loss": 0.0, "kl": 0.0, "clip_low": 0.0, "clip_high": 0.0, "entropy": 0.0}
        for rows in chunks:
            surrogate.backward(rows, *logprobs(rows), totals)
        norm = clip_gradients(policy.params, g.max_grad_norm)
        optimizer.step()
    return {**totals, "grad_norm": norm, "micro_batches": len(chunks)}


def _fixed_logprobs(
    policy: Policy, logprobs: Scorer, chunks: list[Tensor], num_iterations: int, beta: float
) -> tuple[Tensor | None, Tensor | None]:
    """(B, T) log-probs fixed for the whole update, before its first step: the old policy's
    (None with one iteration: the current log-probs, detached, are the old ones) and the
    frozen reference's (None without a KL term)."""
    with torch.no_grad():
        old_logp = torch.cat([logprobs(c)[0] for c in chunks]) if num_iterations > 1 else None
        ref_logp = None
        if beta != 0.0:
            with policy.frozen_reference():
                ref_logp = torch.cat([logprobs(c)[0] for c in chunks])  # (B, T)
    return old_logp, ref_logp


@dataclass(frozen=True)
class _Surrogate:
    """The update's loss on one micro-batch; everything but the rows is fixed for the update."""

    g: GRPOConfig
    variant: losses.Variant
    batch: Rollout
    advantages: Tensor  # (B,) or (B, T)
    mask: Tensor  # (B, T) the loss mask
    counts: losses.Counts  # the whole step's
    beta: float
    old_logp: Tensor | None  # (B, T); None: the current log-probs, detached
    ref_logp: Tensor | None  # (B, T); None: no KL term
    completion_tokens: int  # every completion token of the batch (the entropy's denominator)

    def backward(
        self, rows: Tensor, logp: Tensor, entropy: Tensor, totals: dict[str, float]
    ) -> None:
        """Backpropagate the loss of ``rows`` (b,) from their log-probs and entropies (b, T);
        add its share of the step's metrics to ``totals``."""
        g, batch, mask = self.g, self.batch, self.mask
        completion_tokens = self.completion_tokens
        old = logp.detach() if self.old_logp is None else self.old_logp[rows]
        loss, token = losses.policy_loss(
            self.variant,
            logp,
            old,
            self.advantages[rows],
            mask[rows],
            self.counts._replace(group_tokens=self.counts.group_tokens[rows]),
            ref_logp=None if self.ref_logp is None else self.ref_logp[rows],
            beta=self.beta,
            epsilon_low=g.epsilon_low,
            epsilon_high=g.epsilon_high,
        )
        if g.entropy.coef != 0.0:  # the bonus
            loss = loss + losses.entropy_bonus(
                entropy, batch.mask[rows], completion_tokens, g.entropy.coef
            )
        loss.backward()
        _accumulate(totals, loss, token, self.advantages[rows], mask[rows], self.counts)
        totals["entropy"] += float((entropy.detach() * batch.mask[rows]).sum()) / max(
            completion_tokens, 1
        )


def _accumulate(
    totals: dict[str, float],
    loss: Tensor,
    token: losses.TokenLoss,
    advantages: Tensor,
    mask: Tensor,
    counts: losses.Counts,
) -> None:
    """Token-weighted sums over micro-batches: every metric ends as a mean over the step."""
    share = float(mask.sum()) / max(counts.num_tokens, 1)
    low, high = losses.clip_fractions(token, advantages, mask)
    totals["loss"] += float(loss.detach())
    totals["clip_low"] += low * share
    totals["clip_high"] += high * share
    if token.kl is not None:
        totals["kl"] += float((token.kl.detach() * mask).sum()) / max(counts.num_tokens, 1)
