"""Per-token PRM credit for the GRPO recipe (``grpo.prm_credit: step``; docs/process-rewards.md §2).

The ``prm`` reward gives each completion one number, R = w_o * O + w_p * G_1, where G_k is the
completion's value from step k on (``essa.rewards.prm.step_returns``; PURE's min-form value
``min_{j >= k} r'_j`` with ``aggregate: min``). Step credit keeps the variant's group advantage
A_i of R and adds, on each token t of step k(t),

    A_{i,t} = A_i + w_p * (G_{k(t)} - G_1)

so the tokens of the first step (and every token when all later steps are at least as good)
keep the sequence-level advantage, and a token is credited or blamed by how the steps from its
own on compare with the whole completion: a bad first step is the whole completion's fault, a
bad late step only its own and the later ones'. Steps are character spans of the decoded text;
a token belongs to the first step whose end lies after the token's first character (tokens
after the last step, such as EOS, to the last step).

In the GRPO step, :func:`step_credit_advantages` is the advantage hook (essa/gradient/hooks.py):
the credit comes from the sampling's PRM pass (essa/gradient/sampling.py), so no model runs here.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch

from essa.errors import UserError
from essa.gradient.hooks import Record, RowAdvantages, StepBatch
from essa.gradient.policy import Rollout
from essa.rewards.base import Reward


def token_steps(char_ends: Sequence[int], step_ends: Sequence[int]) -> list[int]:
    """The step index of each token, from the tokens' character ends (cumulative, exclusive).

    Token t starts at ``char_ends[t - 1]`` (0 for t = 0) and belongs to the first step whose end
    lies after that; the ends are non-decreasing, so each step's first token is a bisection and
    only O(K log T) of ``char_ends`` are read (a lazy :class:`PrefixEnds` decodes just those).

    >>> token_steps([2, 4, 7, 9], [3, 8])  # tokens [0,2) [2,4) [4,7) [7,9); steps end at 3, 8
    [0, 0, 1, 1]
    """
    n = len(char_ends)
    steps: list[int] = []
    for j, end in enumerate(step_ends):  # tokens starting before this step's end: steps <= j
        count = 1 + bisect.bisect_left(char_ends, end, 0, max(n - 1, 0))
        steps.extend([j] * (min(count, n) - len(steps)))
    return steps + [len(step_ends) - 1] * (n - len(steps))  # after the last step: the last


class PrefixEnds(Sequence[int]):
    """``len(decode(ids[: t + 1]))`` for each t, decoded on first access only."""

    def __init__(self, tokenizer: Any, ids: Sequence[int]) -> None:
        self.tokenizer, self.ids = tokenizer, list(ids)
        self._cache: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, t: int) -> int:  # type: ignore[override]
        if t not in self._cache:
            prefix = self.ids[: t + 1]
            self._cache[t] = len(self.tokenizer.decode(prefix, skip_special_tokens=True))
        return self._cache[t]


def char_ends(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """Each completion token's character end in the decoded completion (prefix decodes, so
    tokens that only complete a multi-byte character are attributed where the text grows)."""
    ends = PrefixEnds(tokenizer, ids)
    return [ends[t] for t in range(len(ends))]


def step_credit(tokenizer: Any, out: Rollout, prompts: list[str], reward: Reward) -> torch.Tensor:
    """(B, T) ``w_p * (G_{k(t)} - G_1)`` on the rollout's completion tokens, 0 elsewhere."""
    steps_of = getattr(reward.fn, "steps", None)
    if steps_of is None:  # config validation allows only reward.name: prm here
        raise UserError(f"grpo.prm_credit: reward {reward.name!r} gives no step scores")
    weight = float(reward.fn.prm_weight)  # type: ignore[attr-defined]
    credit = torch.zeros_like(out.mask)  # (B, T)
    for b, (ends, values) in enumerate(steps_of(out.texts, prompts)):
        if len(values) < 2:  # one step (or none): the sequence-level advantage is all there is
            continue
        n = int(out.mask[b].sum())
        ids = out.completion_ids[b, :n].tolist()
        ks = token_steps(PrefixEnds(tokenizer, ids), ends)  # O(K log T) prefix decodes
        credit[b, :n] = weight * (torch.tensor([values[k] for k in ks]) - values[0])
    return credit


def with_step_credit(
    values: torch.Tensor, credit: Sequence[torch.Tensor], mask: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """Group advantages (B,) plus each round's step credit (n_i*G, T_i), padded to the batch's
    T: ``A_i + w_p (G_k(t) - G_1)``, (B, T); and the mean |credit| over completion tokens (how
    far the credit moved the advantages). ``mask`` (B, T): the completion tokens."""
    width = mask.shape[1]
    padded = torch.cat([torch.nn.functional.pad(c, (0, width - c.shape[1])) for c in credit])
    tokens = mask.sum().clamp(min=1)
    return values[:, None] + padded, float((padded.abs() * mask).sum() / tokens)


def step_credit_advantages(adv: RowAdvantages, rows: StepBatch) -> tuple[RowAdvantages, Record]:
    """``grpo.prm_credit: step`` as an advantage hook: the group advantages (B,) become
    ``A_i + w_p (G_k(t) - G_1)`` (B, T); logs prm_step_credit, the mean |credit| per token."""
    values, moved = with_step_credit(adv.values, rows.credit, rows.rollout.mask)
    return RowAdvantages(values, adv.keep), {"prm_step_credit": moved}
