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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from essa.errors import UserError
from essa.recipes.grpo_policy import Rollout
from essa.rewards.base import Reward


def token_steps(char_ends: Sequence[int], step_ends: Sequence[int]) -> list[int]:
    """The step index of each token, from the tokens' character ends (cumulative, exclusive).

    >>> token_steps([2, 4, 7, 9], [3, 8])  # tokens [0,2) [2,4) [4,7) [7,9); steps end at 3, 8
    [0, 0, 1, 1]
    """
    steps, start = [], 0
    for end in char_ends:
        k = next((j for j, e in enumerate(step_ends) if e > start), len(step_ends) - 1)
        steps.append(k)
        start = end
    return steps


def char_ends(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """Each completion token's character end in the decoded completion (prefix decodes, so
    tokens that only complete a multi-byte character are attributed where the text grows)."""
    return [len(tokenizer.decode(list(ids[: t + 1]), skip_special_tokens=True))
            for t in range(len(ids))]  # fmt: skip


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
        ks = token_steps(char_ends(tokenizer, ids), ends)
        credit[b, :n] = weight * (torch.tensor([values[k] for k in ks]) - values[0])
    return credit
