"""PRIME implicit process rewards for the GRPO recipe (``grpo.prime``; Cui et al., "Process
Reinforcement through Implicit Rewards", arXiv 2502.01456). Spec: docs/process-rewards.md §3.

The implicit PRM is a second copy of the policy's LoRA factors, phi, initialised from the SFT
adapter, on the same base model; the reference is the SFT adapter. Per step:

1. token process rewards ``r_t = beta * (log pi_phi(y_t | y_<t) - log pi_ref(y_t | y_<t))``
   from one forward of phi (and one of the reference), before phi is updated ("single forward");
2. phi takes one AdamW step on the cross-entropy of ``sigmoid(sum_t r_t)`` against the outcome
   label (the reward, clipped to [0, 1]);
3. advantages per token: ``A_t = w_p * sum_{s >= t} (r_s - b_i) + w_o * (R_i - mean_{j != i} R_j)``
   with ``b_i = mean_{j != i} (sum_s r^j_s / |y^j|)`` over the other completions of the prompt
   (leave-one-out, gamma = 1), whitened over the step's tokens; they replace the variant's
   group advantages in its clipped surrogate (normaliser, clip range and KL unchanged).

Deviations from the paper: phi is a LoRA copy, not a full model; its log-probs use temperature
1 (the policy's use grpo.temperature); the prompt filter is the variant's group filter, not
PRIME's accuracy band; the process baseline is the paper's eq. (5) leave-one-out mean (verl's
``masked_rloo`` adds (r_t - mean_i)/(K - 1)); a non-binary reward is clipped to [0, 1] as a
soft label; ungradable (None) rewards take no part in the PRM loss and get outcome advantage 0.

In the GRPO step, :class:`ProcessAdvantages` is the advantage hook (essa/gradient/hooks.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from essa.config import GRPOConfig, PrimeConfig
from essa.gradient.checkpoint import Trained
from essa.gradient.hooks import Record, RowAdvantages, StepBatch
from essa.gradient.policy import Policy, Rollout, micro_batches, select, token_logprobs
from essa.gradient.schedule import clip_gradients

WHITEN_EPS = 1e-8  # verl masked_whiten


# ---------------------------------------------------------------------------------------------
# The maths, on tensors


def implicit_token_rewards(logp: Tensor, ref_logp: Tensor, mask: Tensor, beta: float) -> Tensor:
    """``r_t = beta * (log pi_phi - log pi_ref)`` on completion tokens, 0 elsewhere: (B, T)."""
    return beta * (logp - ref_logp) * mask


def prm_loss(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    labels: Tensor,
    beta: float,
    num_labelled: int | None = None,
) -> Tensor:
    """PRIME's L_CE: ``-mean_i [l_i log sigmoid(s_i) + (1 - l_i) log(1 - sigmoid(s_i))]`` with
    ``s_i = sum_t r_t`` and ``l_i`` = ``labels`` (B,) clipped to [0, 1]; NaN labels are left out.

    ``num_labelled`` is the whole step's count of labelled rows, so micro-batches sum exactly.
    """
    scores = implicit_token_rewards(logp, ref_logp, mask, beta).sum(-1)  # (B,)
    valid = ~torch.isnan(labels)  # (B,)
    count = int(valid.sum()) if num_labelled is None else num_labelled
    total = torch.nn.functional.binary_cross_entropy_with_logits(
        scores[valid], labels[valid].clamp(0.0, 1.0).to(scores.dtype), reduction="sum"
    )
    return total / max(count, 1)


def leave_one_out(values: Tensor) -> Tensor:
    """RLOO: ``v_i - mean_{j != i} v_j`` within each group (N, G); NaN entries are left out of
    the means and get 0, as does an entry with no other finite value."""
    valid = ~torch.isnan(values)  # (N, G)
    filled = torch.where(valid, values, torch.zeros_like(values))
    others = valid.sum(-1, keepdim=True) - valid.long()  # (N, G)
    baseline = (filled.sum(-1, keepdim=True) - filled) / others.clamp(min=1)
    return torch.where(valid & (others > 0), values - baseline, torch.zeros_like(values))


def masked_whiten(values: Tensor, mask: Tensor) -> Tensor:
    """``(a - mean) / sqrt(var + 1e-8)`` over the masked entries, Bessel-corrected (verl)."""
    count = mask.sum()
    mean = (values * mask).sum() / count.clamp(min=1)
    var = (((values - mean) ** 2) * mask).sum() / (count - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + WHITEN_EPS)


def prime_advantages(
    outcome: Tensor,
    token_rewards: Tensor,
    mask: Tensor,
    *,
    process_weight: float,
    outcome_weight: float,
    use_whitening: bool,
) -> Tensor:
    """Token advantages (B, T), B = N * G rows in group order (module docstring, step 3)."""
    n, g = outcome.shape
    lengths = mask.sum(-1).clamp(min=1)  # (B,)
    per_token = ((token_rewards * mask).sum(-1) / lengths).view(n, g)  # (N, G)
    baseline = (per_token.sum(-1, keepdim=True) - per_token) / max(g - 1, 1)  # (N, G)
    process = (token_rewards - baseline.reshape(-1, 1)) * mask  # (B, T)
    returns = process.flip(-1).cumsum(-1).flip(-1)  # (B, T): sum over s >= t (gamma = 1)
    outcome_adv = leave_one_out(outcome).reshape(-1, 1)  # (B, 1)
    adv = (process_weight * returns + outcome_weight * outcome_adv) * mask
    return (masked_whiten(adv, mask) if use_whitening else adv) * mask


# ---------------------------------------------------------------------------------------------
# The implicit PRM: a LoRA copy trained online


class _WithParams:
    """``model`` with its LoRA tensors replaced by phi for one call (torch.func)."""

    def __init__(self, model: Any, tensors: dict[str, Tensor]) -> None:
        self.model, self.tensors = model, tensors

    def parameters(self) -> Any:
        return iter(self.tensors.values())

    def __call__(self, **kwargs: Any) -> Any:
        return torch.func.functional_call(self.model, self.tensors, args=(), kwargs=kwargs)


@dataclass
class ImplicitPRM:
    """phi (the LoRA tensors of the implicit PRM) and its AdamW."""

    cfg: PrimeConfig
    names: list[str]  # the policy's LoRA parameter names, in Policy.params order
    params: list[Tensor]  # phi
    optimizer: torch.optim.AdamW

    @classmethod
    def build(cls, g: GRPOConfig, policy: Policy) -> ImplicitPRM | None:
        p = g.prime
        if not p.enabled:
            return None
        names = [n for n, _ in policy.model.named_parameters() if "lora_" in n]
        params = [ref.detach().clone().requires_grad_(True) for ref in policy.reference]
        lr = g.lr if p.prm_lr is None else p.prm_lr
        return cls(p, names, params, torch.optim.AdamW(params, lr=lr, weight_decay=0.0))

    def logprobs(self, policy: Policy, rows: Rollout, t: int) -> Tensor:
        """log pi_phi of the completion tokens, with gradient to phi: (b, T)."""
        model = _WithParams(policy.model, dict(zip(self.names, self.params, strict=True)))
        return token_logprobs(model, rows.input_ids, rows.attention_mask, t, 1.0)[0]

    def step(
        self, policy: Policy, batch: Rollout, outcome: Tensor, g: GRPOConfig
    ) -> tuple[Tensor, dict[str, float | None]]:
        """Rewards from phi, one PRM update, token advantages (B, T) and the step's metrics.

        ``g``: grpo.grad_accumulation (micro-batches) and grpo.max_grad_norm (the clip)."""
        t = batch.completion_ids.shape[1]
        chunks = micro_batches(policy.model, batch.mask.shape[0], t, g.grad_accumulation)
        labels = outcome.flatten()  # (B,)
        labelled = int((~torch.isnan(labels)).sum())
        with torch.no_grad(), policy.frozen_reference():
            ref = torch.cat([
                token_logprobs(policy.model, batch.input_ids[c], batch.attention_mask[c], t, 1.0)[0]
                for c in chunks
            ])  # (B, T)  # fmt: skip
        self.optimizer.zero_grad(set_to_none=True)
        rewards, loss_total = [], 0.0
        for c in chunks:
            logp = self.logprobs(policy, select(batch, c), t)  # (b, T)
            rewards.append(
                implicit_token_rewards(logp.detach(), ref[c], batch.mask[c], self.cfg.beta)
            )
            if labelled:
                loss = prm_loss(logp, ref[c], batch.mask[c], labels[c], self.cfg.beta, labelled)
                loss.backward()
                loss_total += float(loss.detach())
        if labelled:
            clip_gradients(self.params, g.max_grad_norm)  # the policy's clipping norm
            self.optimizer.step()
        token_rewards = torch.cat(rewards)  # (B, T)
        advantages = prime_advantages(
            outcome,
            token_rewards,
            batch.mask,
            process_weight=self.cfg.process_weight,
            outcome_weight=self.cfg.outcome_weight,
            use_whitening=self.cfg.use_whitening,
        )
        return advantages, _metrics(token_rewards, labels, loss_total if labelled else None)

    def trained(self) -> Trained:
        """phi and its AdamW, as the checkpoint stores them beside the policy."""
        missing = "the checkpoint has no implicit PRM (the run started without grpo.prime.enabled)"
        return Trained("prime", self.params, self.optimizer, missing)


@dataclass(frozen=True)
class ProcessAdvantages:
    """``grpo.prime`` as an advantage hook: PRIME's token advantages (B, T) replace the group's
    (the rows kept stay the variant's); logs prm_loss, process_reward and prm_accuracy."""

    prm: ImplicitPRM
    policy: Policy
    g: GRPOConfig  # grpo.grad_accumulation and grpo.max_grad_norm, for the PRM's own step

    def __call__(self, adv: RowAdvantages, rows: StepBatch) -> tuple[RowAdvantages, Record]:
        values, metrics = self.prm.step(self.policy, rows.rollout, rows.rewards, self.g)
        return RowAdvantages(values, adv.keep), dict(metrics)


def _metrics(token_rewards: Tensor, labels: Tensor, loss: float | None) -> dict[str, float | None]:
    """prm_loss, the mean sequence-level process reward and the PRM's accuracy on the labels."""
    scores = token_rewards.sum(-1)  # (B,)
    valid = ~torch.isnan(labels)
    right = (scores[valid] > 0) == (labels[valid] > 0.5)
    return {
        "prm_loss": loss,
        "process_reward": float(scores.mean()),
        "prm_accuracy": float(right.float().mean()) if bool(valid.any()) else None,
    }
