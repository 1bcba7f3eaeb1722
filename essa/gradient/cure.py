"""CURE's first stage in the GRPO loop: branch every rollout at a high-entropy critical token.

CURE (Li et al., "Critical-Token-Guided Re-concatenation for Entropy-collapse Prevention",
arXiv 2508.11016; reference code bytedance/CURE ``recipe/CURE_First_Stage``). Per prompt, of a
group of G = n1 * (1 + n2) completions (``grpo.group_size``, n2 = ``grpo.cure.branches``):

1. sample n1 originals from the prompt q;
2. score each original's tokens by the entropy of the policy at the sampling temperature;
3. pick its critical position j uniformly among its ``top_k_tokens`` highest-entropy candidate
   positions (completion tokens before and including EOS, not position 0, no special token);
4. sample n2 branches from q + o[:j]: the critical token and everything after is re-sampled;
5. the n1 originals and n1 * n2 branches form one group of G: one reward baseline, one GRPO
   loss. A branch trains only on its own new tokens (the prefix is context), as in the reference.

``grpo.cure.stage1_steps`` steps branch; after them the loop samples plainly (stage 2).
Formulas, settings and the full list of choices: docs/cure.md.

Deviations from the paper's code:
* the entropy comes from one no-grad forward of the rollout policy over the originals (the
  reference calls ``compute_log_prob`` the same way), micro-batched like the update;
* no text filter: the reference also skips tokens whose decoded text, stripped, is under two
  characters (digits, punctuation, whitespace), a BPE heuristic that on the demo's
  character-level tokenizer would reject every token;
* a branch is scored on its whole trajectory o[:j] + continuation (verl's reward reads only
  the continuation; our short answers often start in the prefix), and its continuation gets
  ``max_new_tokens - j`` tokens, so a trajectory is never longer than an original may be;
* an original with no candidate (one token, or only specials) branches from the prompt (j = 0),
  as the reference's fallback; such rows are counted, not hidden.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from essa import seeding
from essa.config import CureConfig, GRPOConfig
from essa.gradient.policy import (
    Policy,
    Rollout,
    Sampling,
    merge,
    micro_batches,
    rollout,
    rollout_from_ids,
    select,
    token_logprobs,
)

Sampler = Callable[..., Rollout]  # rollout(policy, tokenizer, prompts, sampling, seed, progress, T)


def is_active(cfg: CureConfig, step: int) -> bool:
    """Stage 1: branching is on and ``step`` comes before ``stage1_steps``."""
    return cfg.use_branching and (cfg.stage1_steps is None or step < cfg.stage1_steps)


@dataclass
class Tally:
    """One step's CURE counts, summed over its sampling rounds (the metrics.jsonl fields)."""

    branches: int = 0  # branch completions sampled
    fallbacks: int = 0  # originals without a candidate token, branched from the prompt
    critical: int = 0  # originals branched at a critical token
    entropy_sum: float = 0.0  # entropy at their critical tokens, summed

    def metrics(self) -> dict[str, float]:
        """The step's fields; the entropy only when some original had a critical token."""
        fields: dict[str, float] = {
            "cure_branches": self.branches,
            "cure_fallbacks": self.fallbacks,
        }
        if self.critical:
            fields["cure_critical_entropy"] = self.entropy_sum / self.critical
        return fields


def branching(g: GRPOConfig, tally: Tally) -> Sampler:
    """Stage 1's rollout function, counting into ``tally``: :func:`branched_rollout`."""
    return functools.partial(branched_rollout, g=g, tally=tally)


# ---------------------------------------------------------------------------------------------
# The critical token


def candidate_positions(out: Rollout, special_ids: Sequence[int]) -> torch.Tensor:
    """(B, T) bool: completion tokens up to and including EOS, except position 0 and specials.

    Position 0 is excluded as in the reference: a branch there is a plain resample of q.
    """
    special = torch.isin(out.completion_ids, torch.tensor(sorted(set(special_ids))))  # (B, T)
    candidates = out.mask.bool() & ~special  # (B, T)
    candidates[:, 0] = False
    return candidates


def choose_critical(
    entropy: torch.Tensor, candidates: torch.Tensor, top_k: int, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, a position drawn uniformly among its ``top_k`` highest-entropy candidates.

    ``entropy``, ``candidates``: (B, T). Ties rank the earlier position first. Returns the
    positions (B,) long and whether each row had a candidate (B,) bool; a row without one gets
    position 0 (branch from the prompt). ``rng`` draws once per row that has a candidate.
    """
    ranked = torch.where(candidates, entropy, -torch.inf)  # (B, T)
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices  # (B, T)
    counts = candidates.sum(-1).clamp(max=top_k)  # (B,)
    positions = torch.zeros(entropy.shape[0], dtype=torch.long)
    for row, count in enumerate(counts.tolist()):
        if count:
            positions[row] = order[row, int(rng.integers(count))]
    return positions, counts > 0


@torch.no_grad()
def rollout_entropy(
    policy: Policy, out: Rollout, temperature: float, grad_accumulation: int
) -> torch.Tensor:
    """(B, T) entropy of the policy's sampling distribution (logits / temperature) per token.

    Micro-batched as the update is (``grpo.grad_accumulation``), so it fits where training does.
    """
    t = out.completion_ids.shape[1]
    rows = micro_batches(policy.model, len(out.texts), t, grad_accumulation)
    parts = []
    with policy.inference():
        for r in rows:
            ids, attention = out.input_ids[r], out.attention_mask[r]
            parts.append(token_logprobs(policy.model, ids, attention, t, temperature)[1])
    return torch.cat(parts)


# ---------------------------------------------------------------------------------------------
# Branching


def branch_contexts(
    out: Rollout, positions: torch.Tensor, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q + o[:j] of every row, left-padded: input ids and attention mask, 2 x (B, P + max j)."""
    prompt = out.input_ids.shape[1] - out.completion_ids.shape[1]
    width = prompt + int(positions.max())
    ids = torch.full((len(positions), width), pad_token_id, dtype=out.input_ids.dtype)
    attention = torch.zeros((len(positions), width), dtype=out.attention_mask.dtype)
    for row, j in enumerate(positions.tolist()):
        ids[row, width - prompt - j :] = out.input_ids[row, : prompt + j]
        attention[row, width - prompt - j :] = out.attention_mask[row, : prompt + j]
    return ids, attention


def branched_rollout(
    policy: Policy,
    tokenizer: Any,
    prompts: Sequence[str],
    sampling: Sampling,
    seed: int,
    progress: Callable[[int], None] | None = None,
    temperature: float | None = None,
    *,
    g: GRPOConfig,
    tally: Tally,
) -> Rollout:
    """Stage 1 in place of :func:`rollout`: the same rows, each run of G equal prompts filled
    with n1 originals then their n1 * n2 branches, all sampled at ``temperature`` (default
    sampling.temperature, as :func:`rollout`). Randomness comes from ``seed`` alone. ``g``:
    the group size and ``grpo.cure``; the critical tokens' entropy is at grpo.temperature."""
    n2 = g.cure.branches
    n1 = g.group_size // (1 + n2)
    groups = len(prompts) // g.group_size
    firsts = [prompts[k * g.group_size] for k in range(groups) for _ in range(n1)]
    originals = rollout(policy, tokenizer, firsts, sampling, seed, progress, temperature)  # N*n1
    entropy = rollout_entropy(policy, originals, g.temperature, g.grad_accumulation)  # (N*n1, T)
    special = [*tokenizer.all_special_ids, tokenizer.eos_token_id, tokenizer.pad_token_id]
    candidates = candidate_positions(originals, [i for i in special if i is not None])
    rng = seeding.rng(seed, "cure.critical")
    positions, found = choose_critical(entropy, candidates, g.cure.top_k_tokens, rng)
    ids, attention = branch_contexts(originals, positions, tokenizer.pad_token_id)
    budgets = sampling.generation.new_tokens - positions  # (N * n1,) the trajectory's room
    branch_seed = seeding.seed_int(seed, "cure.branches")
    branches = rollout_from_ids(
        policy,
        tokenizer,
        ids.repeat_interleave(n2, 0),
        attention.repeat_interleave(n2, 0),
        sampling,
        branch_seed,
        progress,
        budgets.repeat_interleave(n2),
        temperature,
    )  # N * n1 * n2 rows: original i's branches at rows i * n2 ...
    branches = _with_trajectory_texts(branches, originals, positions, n2, tokenizer)
    tally.branches += len(branches.texts)
    tally.fallbacks += int((~found).sum())
    tally.critical += int(found.sum())
    tally.entropy_sum += float(entropy[torch.arange(len(positions)), positions][found].sum())
    return _group_order(merge([originals, branches], tokenizer.pad_token_id), groups, n1, n2)


def _with_trajectory_texts(
    branches: Rollout, originals: Rollout, positions: torch.Tensor, n2: int, tokenizer: Any
) -> Rollout:
    """Each branch's text is its whole trajectory o[:j] + continuation: what the reward reads."""
    pad = tokenizer.pad_token_id
    continuations = torch.where(branches.mask.bool(), branches.completion_ids, pad)  # (B2, T2)
    ids = [
        originals.completion_ids[row // n2, : int(positions[row // n2])].tolist() + tokens
        for row, tokens in enumerate(continuations.tolist())
    ]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    return dataclasses.replace(branches, texts=texts)


def _group_order(batch: Rollout, groups: int, n1: int, n2: int) -> Rollout:
    """Rows [originals (N * n1); branches (N * n1 * n2)] -> per group n1 originals, then the
    n1 * n2 branches of those originals, so each group's G rows are contiguous."""
    order: list[int] = []
    for k in range(groups):
        order += range(k * n1, (k + 1) * n1)
        start = groups * n1 + k * n1 * n2
        order += range(start, start + n1 * n2)
    return select(batch, torch.tensor(order))
