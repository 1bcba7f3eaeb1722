"""The GRPO family as pure functions on tensors: advantages, token losses, normalisers, presets.

Each function names its paper and, as "spec §N", the section of the project's GRPO-family
specification it implements (kept with the design notes, outside the package); nothing here touches a model, an optimizer or a global: each function maps tensors to tensors,
and the one piece of running state (DCPO's per-prompt statistics) is passed in and returned.

Shapes: N prompts (groups) of G completions each; B = N * G completion rows of T tokens.
Rewards are ``(N, G)`` float tensors with NaN where the reward was None (not gradable).

A variant (:data:`VARIANTS`, :func:`get_variant`; the table is in :mod:`essa.grpo_variants`)
is a preset: how advantages are formed, which normaliser aggregates the token losses, the clip
range, beta (KL k3), dual-clip, the group filter (dynamic sampling) and whether truncated
completions are masked. The recipe logs the preset.

Deviations, all deliberate and small:
* NaN (ungradable) rewards are left out of every group statistic and get advantage 0, as in TRL
  (spec §6); a group with fewer than two gradable rewards has std 0.
* log rho is not clamped to [-20, 20] (verl does); the dual-clip covers the exploding case.
* The normalisers take the whole step's counts (sequences, tokens, tokens per group) as
  arguments, so a batch split into micro-batches sums to exactly the full-batch loss; TRL divides
  each micro-batch by the gradient-accumulation count instead, which agrees when micro-batches
  are equal in size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from essa.grpo_variants import (
    TRL_EPS_STD,
    VERL_EPS_STD,
    GroupFilter,
    Normaliser,
    Variant,
    get_variant,
)
from essa.grpo_variants import VARIANTS as VARIANTS  # the presets' table, re-exported

if TYPE_CHECKING:
    from essa.config import GRPOConfig


class Advantages(NamedTuple):
    values: Tensor  # (N, G) advantage of each completion, shared by all its tokens
    keep: Tensor  # (N, G) bool: the completion takes part in the loss (PSR/NSR drop some)


# ---------------------------------------------------------------------------------------------
# Group statistics (NaN = not gradable)


def group_mean_std(rewards: Tensor) -> tuple[Tensor, Tensor]:
    """nanmean and Bessel-corrected nanstd over the last dim: (N, G) -> 2 x (N, 1).

    NaN rewards are left out; the std is 0 with fewer than two gradable values.
    """
    valid = ~torch.isnan(rewards)  # (N, G)
    count = valid.sum(-1, keepdim=True)  # (N, 1)
    mean = torch.nanmean(rewards, dim=-1, keepdim=True)  # (N, 1); NaN for an all-NaN group
    squares = torch.where(valid, (rewards - mean) ** 2, torch.zeros_like(rewards))  # (N, G)
    var = squares.sum(-1, keepdim=True) / (count - 1).clamp(min=1)  # (N, 1)
    return mean, torch.sqrt(var)


def _finite_or_zero(values: Tensor) -> Tensor:
    return torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)


def _keep_gradable(rewards: Tensor) -> Tensor:
    # Ungradable completions stay in the batch with advantage 0 (TRL), so they still count
    # in the token normalisers exactly as TRL counts them.
    return torch.ones_like(rewards, dtype=torch.bool)


# ---------------------------------------------------------------------------------------------
# Advantages (spec §2, §4, §7, §8.2, §9)


def std_normalized_advantages(rewards: Tensor, eps_std: float = TRL_EPS_STD) -> Advantages:
    """GRPO / DAPO (spec §2): Â_i = (r_i − mean(r)) / (std(r) + ε_std), sample std.

    A zero-std group gets Â = 0 (counted by TRL in ``frac_reward_zero_std``). One correct out
    of 8 (0/1 rewards) gives +2.474 and −0.354 (spec §2.1: +2.475 / −0.354 without ε_std).
    """
    mean, std = group_mean_std(rewards)  # (N, 1), (N, 1)
    values = (rewards - mean) / (std + eps_std)  # (N, G)
    return Advantages(_finite_or_zero(values), _keep_gradable(rewards))


def centered_advantages(rewards: Tensor) -> Advantages:
    """Dr. GRPO (spec §4): Â_i = r_i − mean(r), no std division."""
    mean, _ = group_mean_std(rewards)  # (N, 1)
    return Advantages(_finite_or_zero(rewards - mean), _keep_gradable(rewards))


def ngrpo_advantages(
    rewards: Tensor,
    r_max: float = 1.0,
    num_virtual: int = 1,
    eps_std: float = VERL_EPS_STD,
) -> Advantages:
    """NGRPO (spec §7): statistics over R′ = {r_1..r_G} ∪ {r_max}×K; Â_i = (r_i − μ′)/(σ′ + ε).

    Only the G real completions get advantages. An all-wrong group of 8 gets −1/3 each:

    >>> ngrpo_advantages(torch.zeros(1, 8)).values[0, 0].item()  # doctest: +ELLIPSIS
    -0.33333...
    """
    virtual = torch.full(
        (rewards.shape[0], num_virtual), r_max, dtype=rewards.dtype, device=rewards.device
    )  # (N, K)
    mean, std = group_mean_std(torch.cat([rewards, virtual], dim=-1))  # (N, 1) over G + K
    values = (rewards - mean) / (std + eps_std)  # (N, G)
    return Advantages(_finite_or_zero(values), _keep_gradable(rewards))


def _correct(rewards: Tensor) -> Tensor:
    # Rewards are {0, 1} (or {-1, +1}): positive means correct; NaN compares False.
    return rewards > 0


def w_reinforce_advantages(rewards: Tensor, positive_weight: float = 0.1) -> Advantages:
    """W-REINFORCE (spec §9): +λ on correct, −1 on incorrect; no baseline, no std (λ = 0.1)."""
    correct = _correct(rewards)  # (N, G)
    values = torch.where(correct, positive_weight, -1.0).to(rewards.dtype)  # (N, G)
    values = torch.where(torch.isnan(rewards), torch.zeros_like(values), values)
    return Advantages(values, ~torch.isnan(rewards))


def psr_advantages(rewards: Tensor) -> Advantages:
    """PSR (spec §9): +1 on correct completions; incorrect ones are left out of the loss."""
    correct = _correct(rewards)  # (N, G)
    return Advantages(correct.to(rewards.dtype), correct)


def nsr_advantages(rewards: Tensor) -> Advantages:
    """NSR (spec §9): −1 on incorrect completions; correct ones are left out of the loss."""
    incorrect = ~_correct(rewards) & ~torch.isnan(rewards)  # (N, G)
    return Advantages(-incorrect.to(rewards.dtype), incorrect)


@dataclass(frozen=True)
class PromptStats:
    """DCPO's running reward statistics of one prompt over its past visits (spec §8.2)."""

    visits: int  # steps in which this prompt was sampled so far
    mean: float  # μ_total
    var: float  # σ²_total


PromptHistory = Mapping[int, PromptStats]  # stable prompt index -> running statistics


def _standardize(rewards: Tensor, mean: float, std: float, eps_std: float) -> Tensor:
    if std == 0.0 or math.isnan(std):
        return torch.zeros_like(rewards)  # spec §8.2: a zero σ zeroes its standardised term
    return _finite_or_zero((rewards - mean) / (std + eps_std))


def smooth_standardized_advantages(
    rewards: Tensor,
    prompt_ids: list[int],
    history: PromptHistory,
    eps_std: float = VERL_EPS_STD,
) -> tuple[Advantages, dict[int, PromptStats]]:
    """DCPO smooth advantage standardisation (spec §8.2); returns the updated history.

    For a prompt at its i-th visit (counting this one): Â_new standardises by this step's
    group, Â_total by the running statistics including this step, and
    SA_new = ((i−1)/i)·Â_new + (1/i)·Â_total, SA_total = (1/i)·Â_new + ((i−1)/i)·Â_total;
    each completion takes the one smaller in absolute value. The running statistics treat each
    past step as one unit: μ ← (n·μ_old + μ_new)/(n+1),
    σ² ← (n·σ_old² + σ_new² + n/(n+1)·(μ_new − μ_old)²)/(n+1).
    """
    new_history = dict(history)
    rows = []
    for row, prompt_id in zip(rewards, prompt_ids, strict=True):  # row: (G,)
        mean_t, std_t = group_mean_std(row[None, :])
        mean_new, std_new = float(mean_t), float(std_t)
        if math.isnan(mean_new):  # nothing gradable in this group: no signal, no visit
            rows.append(torch.zeros_like(row))
            continue
        old = history.get(prompt_id)
        if old is None:
            stats = PromptStats(1, mean_new, std_new**2)
        else:
            n = old.visits
            mean = (n * old.mean + mean_new) / (n + 1)
            var = (n * old.var + std_new**2 + n / (n + 1) * (mean_new - old.mean) ** 2) / (n + 1)
            stats = PromptStats(n + 1, mean, var)
        new_history[prompt_id] = stats
        i = stats.visits
        a_new = _standardize(row, mean_new, std_new, eps_std)  # (G,)
        a_total = _standardize(row, stats.mean, math.sqrt(stats.var), eps_std)  # (G,)
        sa_new = (i - 1) / i * a_new + a_total / i
        sa_total = a_new / i + (i - 1) / i * a_total
        rows.append(torch.where(sa_new.abs() <= sa_total.abs(), sa_new, sa_total))
    return Advantages(torch.stack(rows), _keep_gradable(rewards)), new_history


# ---------------------------------------------------------------------------------------------
# Group filters (dynamic sampling, spec §5.2 and §7)


def groups_to_keep(rewards: Tensor, group_filter: GroupFilter, r_max: float = 1.0) -> Tensor:
    """(N,) bool. ``mixed``: DAPO keeps groups whose rewards are not all equal (for 0/1 rewards,
    0 < #correct < G); ``not_all_max``: NGRPO drops only all-correct groups."""
    if group_filter == "none":
        return torch.ones(rewards.shape[0], dtype=torch.bool, device=rewards.device)
    valid = ~torch.isnan(rewards)  # (N, G)
    if group_filter == "not_all_max":
        return ~torch.all(~valid | (rewards == r_max), dim=-1)
    low = torch.where(valid, rewards, torch.inf).amin(-1)  # (N,)
    high = torch.where(valid, rewards, -torch.inf).amax(-1)  # (N,)
    return high > low


def soft_overlong_punishment(lengths: Tensor, max_length: int, cache_length: int) -> Tensor:
    """DAPO eq. 13 (spec §5.4b), added to the correctness reward; ``lengths`` (B,) tokens.

    0 up to L_max − L_cache, then a linear ramp to −1 at L_max, and −1 beyond.

    >>> soft_overlong_punishment(torch.tensor([16000, 18432, 20480, 30000]), 20480, 4096)
    tensor([ 0.0000, -0.5000, -1.0000, -1.0000])
    """
    lengths = lengths.to(torch.float64)
    free = max_length - cache_length
    ramp = (free - lengths) / cache_length  # (B,)
    penalty = torch.where(lengths <= free, torch.zeros_like(ramp), ramp)
    return torch.where(lengths > max_length, -torch.ones_like(ramp), penalty).float()


# ---------------------------------------------------------------------------------------------
# Token losses (spec §1, §3, §8.1)


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 estimator (spec §3): exp(Δ) − Δ − 1 with Δ = ref_logp − logp; ≥ 0. (B, T) -> (B, T)."""
    delta = ref_logp - logp  # (B, T)
    return torch.exp(delta) - delta - 1


def dcpo_clip_bounds(
    old_prob: Tensor, epsilon_low: float, epsilon_high: float, dual_clip: float | None
) -> tuple[Tensor, Tensor]:
    """DCPO ratio bounds from the old token probability q (spec §8.1). (B, T) -> 2 x (B, T).

    low = ½ + ½·√max(1 − 4ε_low/q, 0), high = min(½ + ½·√(1 + 4ε_high/q), max(c, 10)).
    """
    low = 0.5 + 0.5 * torch.sqrt(torch.clamp(1 - 4 * epsilon_low / old_prob, min=0.0))
    cap = max(dual_clip or 0.0, 10.0)
    high = torch.clamp(0.5 + 0.5 * torch.sqrt(1 + 4 * epsilon_high / old_prob), max=cap)
    return low, high


class TokenLoss(NamedTuple):
    loss: Tensor  # (B, T) per-token loss ℓ + β·KL, before masking and aggregation
    ratio: Tensor  # (B, T) ρ = π_θ / π_old
    low: Tensor | float  # ratio lower bound(s)
    high: Tensor | float  # ratio upper bound(s)
    kl: Tensor | None  # (B, T) k3, or None when β = 0


def _per_token(advantages: Tensor) -> Tensor:
    """(B,) sequence advantages broadcast over tokens as (B, 1); (B, T) ones pass through."""
    return advantages if advantages.dim() == 2 else advantages[:, None]


def clipped_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    *,
    low: Tensor | float,
    high: Tensor | float,
    dual_clip: float | None = None,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
) -> TokenLoss:
    """ℓ = −min(ρ·Â, clip(ρ, low, high)·Â) (+ dual-clip for Â < 0) + β·k3 (spec §1, §3).

    ``logp``/``old_logp``/``ref_logp`` are (B, T) log-probs of the sampled tokens;
    ``advantages`` is (B,), shared by every token of a completion, or (B, T) per token. With ``old_logp =
    logp.detach()`` (one update per rollout) ρ = 1 and the gradient is Â·∇log π.
    """
    ratio = torch.exp(logp - old_logp)  # (B, T)
    adv = _per_token(advantages)  # (B, 1), or (B, T) token advantages (PRIME)
    bounded = torch.clamp(ratio, torch.as_tensor(low), torch.as_tensor(high))  # (B, T)
    loss = -torch.min(ratio * adv, bounded * adv)  # (B, T)
    if dual_clip is not None:
        # Caps the loss of a negative-advantage token when ρ explodes (verl clip_ratio_c).
        loss = torch.where(adv < 0, torch.min(loss, -dual_clip * adv), loss)
    kl = None
    if beta != 0.0:
        if ref_logp is None:
            raise ValueError("beta != 0 needs ref_logp")
        kl = k3_kl(logp, ref_logp)  # (B, T)
        loss = loss + beta * kl
    return TokenLoss(loss, ratio, low, high, kl)


def clip_fractions(token: TokenLoss, advantages: Tensor, mask: Tensor) -> tuple[float, float]:
    """Fractions of completion tokens clipped below (Â < 0) and above (Â > 0), as TRL logs."""
    adv = _per_token(advantages)  # (B, 1) or (B, T)
    low = (token.ratio < token.low) & (adv < 0)  # (B, T)
    high = (token.ratio > token.high) & (adv > 0)  # (B, T)
    tokens = mask.sum().clamp(min=1)
    return float((low * mask).sum() / tokens), float((high * mask).sum() / tokens)


# ---------------------------------------------------------------------------------------------
# Normalisers (spec §6): how Σ m·ℓ becomes one number


def sequence_mean(per_token: Tensor, mask: Tensor, num_sequences: int | None = None) -> Tensor:
    """Original GRPO (TRL ``grpo``, verl ``seq-mean-token-mean``): mean_i(Σ_t m·ℓ / Σ_t m)."""
    per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
    return per_sequence.sum() / (num_sequences or per_token.shape[0])


def token_mean(per_token: Tensor, mask: Tensor, num_tokens: int | None = None) -> Tensor:
    """DAPO (TRL ``dapo``/``bnpo``, verl ``token-mean``): Σ_{i,t} m·ℓ / Σ_{i,t} m."""
    tokens = num_tokens if num_tokens is not None else int(mask.sum())
    return (per_token * mask).sum() / max(tokens, 1)


def constant_length(
    per_token: Tensor, mask: Tensor, max_length: int, num_sequences: int | None = None
) -> Tensor:
    """Dr. GRPO (TRL ``dr_grpo``, verl ``seq-mean-token-sum-norm``): Σ m·ℓ / (B · L_max)."""
    return (per_token * mask).sum() / ((num_sequences or per_token.shape[0]) * max_length)


def group_token_mean(per_token: Tensor, mask: Tensor, group_tokens: Tensor) -> Tensor:
    """DCPO "only token mean" (spec §8.3): token mean within each group, summed over groups.

    ``group_tokens`` (B,) is the completion-token count of each row's group (whole step).
    """
    return ((per_token * mask).sum(-1) / group_tokens.clamp(min=1)).sum()


class Counts(NamedTuple):
    """The whole step's counts the normalisers divide by (so micro-batches add up exactly)."""

    num_sequences: int
    num_tokens: int
    max_length: int
    group_tokens: Tensor  # (B,) tokens in each row's group


def step_counts(mask: Tensor, group_index: Tensor, max_length: int) -> Counts:
    """Counts of the full step batch: ``mask`` (B, T), ``group_index`` (B,) group of each row."""
    per_row = mask.sum(-1)  # (B,)
    per_group = torch.zeros(int(group_index.max()) + 1, dtype=per_row.dtype).index_add_(
        0, group_index, per_row
    )
    return Counts(mask.shape[0], int(per_row.sum()), max_length, per_group[group_index])


def aggregate(per_token: Tensor, mask: Tensor, normaliser: Normaliser, counts: Counts) -> Tensor:
    """Dispatch to the named normaliser; ``per_token``/``mask`` may be a slice of the step."""
    if normaliser == "sequence_mean":
        return sequence_mean(per_token, mask, counts.num_sequences)
    if normaliser == "token_mean":
        return token_mean(per_token, mask, counts.num_tokens)
    if normaliser == "constant_length":
        return constant_length(per_token, mask, counts.max_length, counts.num_sequences)
    return group_token_mean(per_token, mask, counts.group_tokens)


# ---------------------------------------------------------------------------------------------
# Presets


def preset(g: GRPOConfig) -> dict[str, Any]:
    """``grpo.loss``'s preset with the run's overrides (beta, epsilon_low/high) applied: logged
    with the run, so its numbers say what ran."""
    values = dict(vars(get_variant(g.loss)))
    for key in ("beta", "epsilon_low", "epsilon_high"):
        if getattr(g, key) is not None:
            values[key] = getattr(g, key)
    return values


def beta(g: GRPOConfig) -> float:
    """The KL coefficient in force: ``grpo.beta``, else the variant preset's."""
    return get_variant(g.loss).beta if g.beta is None else g.beta


def history_to_json(history: Mapping[int, PromptStats]) -> dict[str, list[float]]:
    """DCPO's per-prompt statistics as checkpoint JSON."""
    return {str(k): [v.visits, v.mean, v.var] for k, v in history.items()}


def history_from_json(data: Mapping[str, list[float]]) -> dict[int, PromptStats]:
    return {int(k): PromptStats(int(v[0]), v[1], v[2]) for k, v in data.items()}


def advantages(
    variant: Variant,
    rewards: Tensor,
    prompt_ids: list[int] | None = None,
    history: PromptHistory | None = None,
) -> tuple[Advantages, dict[int, PromptStats]]:
    """The variant's advantages of ``rewards`` (N, G); returns the (possibly updated) history.

    Only DCPO reads and updates ``history`` (keyed by ``prompt_ids``, stable across steps).
    """
    history = dict(history or {})
    simple: dict[str, Callable[[Tensor], Advantages]] = {
        "std": lambda r: std_normalized_advantages(r, variant.eps_std),
        "centered": centered_advantages,
        "ngrpo": lambda r: ngrpo_advantages(r, eps_std=variant.eps_std),
        "w_reinforce": lambda r: w_reinforce_advantages(r, variant.positive_weight),
        "psr": psr_advantages,
        "nsr": nsr_advantages,
    }
    if variant.advantage == "smooth":
        if prompt_ids is None:
            raise ValueError("dcpo advantages need prompt_ids")
        return smooth_standardized_advantages(rewards, prompt_ids, history, variant.eps_std)
    return simple[variant.advantage](rewards), history


def policy_loss(
    variant: Variant,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    counts: Counts,
    *,
    ref_logp: Tensor | None = None,
    beta: float | None = None,
    epsilon_low: float | None = None,
    epsilon_high: float | None = None,
) -> tuple[Tensor, TokenLoss]:
    """The variant's scalar loss on (a slice of) the step batch.

    ``logp``, ``old_logp``, ``ref_logp``, ``mask``: (B, T); ``advantages``: (B,). ``beta`` and
    the epsilons override the preset when given. Returns (loss, per-token details).
    """
    beta = variant.beta if beta is None else beta
    eps_low = variant.epsilon_low if epsilon_low is None else epsilon_low
    eps_high = variant.epsilon_high if epsilon_high is None else epsilon_high
    low: Tensor | float
    high: Tensor | float
    if variant.use_dynamic_clip:
        low, high = dcpo_clip_bounds(old_logp.exp(), eps_low, eps_high, variant.dual_clip)
    else:
        low, high = 1.0 - eps_low, 1.0 + eps_high
    token = clipped_token_loss(
        logp,
        old_logp,
        advantages,
        low=low,
        high=high,
        dual_clip=variant.dual_clip,
        ref_logp=ref_logp,
        beta=beta,
    )
    return aggregate(token.loss, mask, variant.normaliser, counts), token


# ---------------------------------------------------------------------------------------------
# Entropy control (docs/grpo-rlep-entropy.md)


def token_entropy(logp_all: Tensor) -> Tensor:
    """Entropy −Σ_v p·log p of each token's distribution: (B, T, V) log-probs -> (B, T)."""
    return -(logp_all.exp() * logp_all).sum(-1)


def entropy_bonus(entropy: Tensor, mask: Tensor, num_tokens: int, coef: float) -> Tensor:
    """1-shot RLVR's entropy loss term, −coef · (token mean of the entropy over the step).

    ``entropy``/``mask`` (b, T) may be a micro-batch slice; ``num_tokens`` counts the whole
    step's completion tokens, so the slices add up to the full-batch term. Added to the loss.
    """
    return -coef * token_mean(entropy, mask, num_tokens)


ERA_BISECTION_STEPS = 30  # the scale is found to 2^-30, below float32 resolution


def era_activation(logits: Tensor, floor: float) -> Tensor:
    """ERA-style entropy floor on the logits (our reading of ERA): (..., V) -> (..., V).

    A token whose distribution softmax(z) has entropy below ``floor`` nats gets z' = s·z with
    the largest s in [0, 1] for which H(softmax(s·z)) >= floor (H falls monotonically in s:
    dH/ds = −s·Var_p(z)), found by bisection; other tokens are unchanged. s is a constant in
    the backward pass. The argmax never moves (s > 0), so greedy decoding is unaffected; a
    floor at or above log V gives s = 0, the uniform distribution.
    """
    if floor <= 0.0:
        return logits
    with torch.no_grad():
        z = logits.detach().float()

        def entropy_at(scale: Tensor) -> Tensor:  # (...,) entropy of softmax(scale·z)
            return token_entropy(torch.log_softmax(z * scale[..., None], dim=-1))

        ones = torch.ones(z.shape[:-1], device=z.device)  # (...,)
        low, high = torch.zeros_like(ones), ones.clone()  # H(low) >= floor > H(high) below
        for _ in range(ERA_BISECTION_STEPS):
            mid = (low + high) / 2
            above = entropy_at(mid) >= floor
            low = torch.where(above, mid, low)
            high = torch.where(above, high, mid)
        scale = torch.where(entropy_at(ones) >= floor, ones, low)  # (...,)
    return logits * scale[..., None].to(logits.dtype)
