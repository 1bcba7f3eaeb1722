"""GRPO's group sampling (essa/recipes/grpo.py): draw a step's prompts, sample G completions
of each, score them, and keep the groups the variant trains on, with every option that acts
while sampling plugged in here:

* DAPO dynamic sampling: when the variant filters degenerate groups, further prompt batches are
  drawn (at most ``MAX_SAMPLING_ROUNDS`` per step) until ``prompts_per_step`` groups are kept;
* DAPO's soft overlong punishment on the rewards (``grpo.overlong_buffer``);
* CURE's stage 1 (``grpo.cure``, essa/gradient/cure.py): groups of originals and branches;
* informative prompts (``data.selection`` / ``data.hints``, essa/data/selection.py): skipped
  prompts are refilled and hinted prompts carry their hint;
* RLEP replay (``grpo.replay``, essa/gradient/replay.py): stored successes join their group;
* PRM step credit (``grpo.prm_credit: step``, essa/gradient/prm_credit.py), taken from the
  same PRM pass as the rewards;
* the staged temperature (``grpo.temperature_schedule``) and 1-shot RLVR's repeated prompt.

:func:`step_batch` lays the kept groups out as the rows the step's hooks see
(essa/gradient/hooks.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from essa import seeding
from essa.config import GRPOConfig
from essa.gradient import cure, losses, replay
from essa.gradient.data import TaskData, draw
from essa.gradient.hooks import StepBatch
from essa.gradient.policy import Policy, Rollout, Sampling, merge, rollout, select
from essa.gradient.prm_credit import step_credit
from essa.gradient.tool_rollout import tool_rollout
from essa.rewards.base import DrawKey, Reward, score
from essa.rewards.extract import extract_answer
from essa.tools.turns import ToolTally

if TYPE_CHECKING:
    from essa.data.selection import Informative
    from essa.harness import Phase

MAX_SAMPLING_ROUNDS = 4  # prompt batches drawn per step at most when groups are filtered


@dataclass
class Groups:
    """The step's training batch: kept groups of G fresh completions and their replays."""

    rollouts: list[Rollout]
    rewards: list[torch.Tensor]  # (n_i, G + k) per round; NaN where a group has < k replays
    prompt_ids: list[int]  # stable training-set index of each kept group
    replays: list[list[replay.Experience]]  # each kept group's replayed successes (<= k)
    credit: list[torch.Tensor] = field(default_factory=list)  # (n_i*G, T_i): prm_credit step


def temperature_at(step: int, g: GRPOConfig) -> float:
    """The rollout temperature of ``step``: the last schedule stage started, else the base.

    A pure function of the step, so a resumed run is at the same stage.

    >>> g = GRPOConfig(temperature=0.6, temperature_schedule=((2, 0.8), (5, 1.0)))
    >>> [temperature_at(s, g) for s in (0, 1, 2, 4, 5, 9)]
    [0.6, 0.6, 0.8, 0.8, 1.0, 1.0]
    """
    temperature = g.temperature
    for start, value in g.temperature_schedule:
        if step >= start:
            temperature = value
    return temperature


def replay_count(g: GRPOConfig) -> int:
    """k: replayed completions per group (0 without replay)."""
    r = g.replay
    return round(r.ratio * g.group_size) if r.capacity and r.ratio > 0 else 0


def draw_prompts(g: GRPOConfig, n_train: int, seed: int, step: int, rounds: int) -> list[int]:
    """One round's prompt indices; a training set smaller than a step (1-shot) repeats."""
    if g.train_examples is not None and n_train < g.prompts_per_step:
        rng = seeding.rng(seed, "grpo.prompts", step, rounds)
        return rng.choice(n_train, size=g.prompts_per_step, replace=True).tolist()
    return draw(n_train, g.prompts_per_step, seed, "grpo.prompts", step, rounds)


def sample_groups(
    g: GRPOConfig,
    sampling: Sampling,
    seed: int,
    variant: losses.Variant,
    policy: Policy,
    tokenizer: Any,
    reward: Reward,
    data: TaskData,
    step: int,
    round_bar: Callable[[int], Phase] | None = None,
    informative: Informative | None = None,
    buffer: replay.ReplayBuffer | None = None,
) -> tuple[Groups, list[replay.Experience], dict[str, float]]:
    """Draw prompts, sample G completions each, score, add replays; resample when filtered.

    Returns the kept groups, the fresh verified successes (for the buffer) and the stats.
    ``seed`` is run.seed; ``sampling`` how rollouts sample (its temperature is replaced by the
    step's, :func:`temperature_at`).
    """
    k = replay_count(g) if buffer is not None else 0
    temperature = temperature_at(step, g)
    kept = Groups([], [], [], [])
    found: list[replay.Experience] = []
    sampled_rewards: list[torch.Tensor] = []
    new_tokens = 0
    rounds = 0
    cure_tally = cure.Tally()
    tool_tally = ToolTally()
    sample = cure.branching(g, cure_tally) if cure.is_active(g.cure, step) else rollout
    if sampling.tools is not None:  # the config refuses CURE with tools
        sample = tool_rollout
    while rounds < MAX_SAMPLING_ROUNDS and len(kept.prompt_ids) < g.prompts_per_step:
        idx = draw_prompts(g, len(data.train), seed, step, rounds)
        if informative is None:
            texts = [data.train_prompts[i] for i in idx]
        else:
            idx = informative.draw(idx, len(data.train), (step, rounds))
            texts = informative.prompts(idx, data.train, data.train_prompts)
        prompts = [text for text in texts for _ in range(g.group_size)]
        answers = [data.train[i].answer for i in idx for _ in range(g.group_size)]
        round_seed = seeding.seed_int(seed, "grpo.sampling", step, rounds)
        if round_bar is None:
            out = sample(policy, tokenizer, prompts, sampling, round_seed, temperature=temperature)
        else:
            with round_bar(len(prompts)) as bar:
                out = sample(
                    policy, tokenizer, prompts, sampling, round_seed, bar.advance, temperature
                )
        # draw keys: (seed, step, round, prompt i of the round, sample j), row-major like out
        keys = [(seed, step, rounds, i, j) for i in range(len(idx)) for j in range(g.group_size)]
        rewards = score_round(g, sampling, reward, out, answers, prompts, keys)  # (B,)
        if out.transcripts is not None:
            finals = [extract_answer(t.turns[-1]) if t.turns else None for t in out.transcripts]
            tool_tally.add(out.transcripts, finals)
        # per-token PRM credit from the same PRM pass (the reward kept its step scores)
        credit = step_credit(tokenizer, out, prompts, reward) if g.prm_credit == "step" else None
        if buffer is not None:
            rows = [i for i in idx for _ in range(g.group_size)]
            found.extend(replay.successes(out, rewards, rows, g.replay.min_reward))
        rewards = rewards.view(len(idx), g.group_size)  # (N, G)
        if informative is not None:
            informative.observe(idx, rewards.double().numpy())
        sampled_rewards.append(rewards)
        new_tokens += int((out.completion_ids != tokenizer.pad_token_id).sum())  # as ESSA counts
        replays: list[list[replay.Experience]] = [[] for _ in idx]
        if k and buffer is not None:
            replays = buffer.draw(idx, k, seeding.rng(seed, "grpo.replay", step, rounds))
        mixed = replay.mixed_group_rewards(rewards, replays, k)  # (N, G + k)
        rounds += 1
        keep = losses.groups_to_keep(mixed, variant.group_filter)  # (N,) over the mixed groups
        room = g.prompts_per_step - len(kept.prompt_ids)
        chosen = torch.nonzero(keep).flatten()[:room]  # (n,)
        if chosen.numel() == 0:
            continue
        rows_kept = (chosen[:, None] * g.group_size + torch.arange(g.group_size)).flatten()
        kept.rollouts.append(select(out, rows_kept))  # (n*G) rows
        if credit is not None:
            kept.credit.append(credit[rows_kept])
        kept.rewards.append(mixed[chosen])
        kept.prompt_ids.extend(idx[i] for i in chosen.tolist())
        kept.replays.extend(replays[i] for i in chosen.tolist())
    every = torch.cat(sampled_rewards)  # (N_all, G) fresh rewards only: the policy's own
    _, std = losses.group_mean_std(every)
    stats = {
        "mean_reward": float(torch.nanmean(every)),
        "frac_reward_zero_std": float((std.flatten() == 0).float().mean()),
        "groups_kept": len(kept.prompt_ids),
        "sampling_rounds": rounds,
        "new_tokens": new_tokens,
        "temperature": temperature,
        **(cure_tally.metrics() if g.cure.use_branching else {}),
        **(tool_tally.metrics() if sampling.tools is not None else {}),
    }
    return kept, found, stats


def score_round(
    g: GRPOConfig,
    sampling: Sampling,
    reward: Reward,
    out: Rollout,
    answers: list[str | None],
    prompts: list[str],
    keys: Sequence[DrawKey],
) -> torch.Tensor:
    """(B,) rewards of a round, NaN where ungradable, plus DAPO's overlong shaping when on."""
    scores = score(reward, out.texts, answers, prompts, keys)
    rewards = torch.tensor([math.nan if s is None else float(s) for s in scores])  # (B,)
    if g.overlong_buffer:
        lengths = out.mask.sum(-1)  # (B,)
        max_length = sampling.generation.new_tokens
        rewards = rewards + losses.soft_overlong_punishment(lengths, max_length, g.overlong_buffer)
    return rewards


def training_batch(
    groups: Groups, data: TaskData, tokenizer: Any, group_size: int
) -> tuple[Rollout, torch.Tensor, torch.Tensor]:
    """The fresh rows (group-major) then the replayed rows, with each row's group and slot.

    Returns (batch, group index (B,), slot index (B,) into the (N, G + k) rewards).
    """
    n = len(groups.prompt_ids)
    group_index = torch.arange(n).repeat_interleave(group_size)  # (N*G,)
    slot = torch.arange(group_size).repeat(n)  # (N*G,)
    replayed = [(i, j, e) for i, group in enumerate(groups.replays) for j, e in enumerate(group)]
    parts = list(groups.rollouts)
    if replayed:
        prompts = [data.train_prompts[e.prompt_id] for _, _, e in replayed]
        parts.append(replay.replay_rollout(tokenizer, prompts, [e for _, _, e in replayed]))
        group_index = torch.cat([group_index, torch.tensor([i for i, _, _ in replayed])])
        slot = torch.cat([slot, torch.tensor([group_size + j for _, j, _ in replayed])])
    return merge(parts, tokenizer.pad_token_id), group_index, slot


def step_batch(groups: Groups, data: TaskData, tokenizer: Any, group_size: int) -> StepBatch:
    """The kept groups as the step's training rows (:func:`training_batch`), with their
    (N, G + k) rewards, prompts and PRM step credit."""
    batch, group_index, slot = training_batch(groups, data, tokenizer, group_size)
    rewards = torch.cat(groups.rewards)  # (N, G + k)
    return StepBatch(batch, rewards, groups.prompt_ids, group_index, slot, groups.credit)
