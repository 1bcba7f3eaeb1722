"""The gradient fallback: the GRPO family on the same task, model, SFT adapter and rewards as ESSA.

The loop, per step: draw ``grpo.prompts_per_step`` training prompts; sample ``grpo.group_size``
completions of each at ``grpo.temperature``; score them with the configured reward; form the
variant's group advantages (resampling away degenerate groups when the variant filters them);
take ``grpo.num_iterations`` AdamW steps on the variant's clipped surrogate (+ beta * k3 KL to
the frozen SFT adapter, − ``grpo.entropy.coef`` * mean token entropy); log and checkpoint.
Optional, all off by default (docs/grpo-rlep-entropy.md): RLEP replay (``grpo.replay``: stored
successes join their prompt's group, essa/gradient/replay.py), an ERA-style entropy floor on
the logits (``grpo.entropy.floor``), a staged temperature (``grpo.temperature_schedule``) and a
training subset (``grpo.train_examples``, 1-shot RLVR). Held-out accuracy is greedy, on the same fixed test
split as ESSA, every ``evaluation.every`` steps, and never feeds back into training.
Formulas and presets, with their papers: essa/gradient/losses.py.
With ``grpo.cure.use_branching``, CURE's first stage (essa/gradient/cure.py, docs/cure.md) fills
each group with originals and their branches from high-entropy critical tokens.

Trainable sets (``grpo.trainable``): ``lora`` continues training the SFT adapter's LoRA
factors; ``singular_values`` trains only offsets to the SFT singular values, in exactly ESSA's
search space (SVD-GRPO), and exports through the same SVD adapter; ``lisa`` merges the SFT LoRA
into the base and trains the base weights with LISA (essa/gradient/lisa.py: embedding, head and
``grpo.lisa.active_layers`` sampled blocks, re-sampled every ``grpo.lisa.interval`` optimizer
steps), exporting the whole model. There is no full-weight mode (``full``) in GRPO.

Deviations from the papers:
* log-probs (of the policy, the old policy and the reference) use logits divided by the
  sampling temperature, as TRL does, so rho and the KL compare sampling distributions;
* the model stays in eval mode while training (no dropout anywhere in the LoRA or the demo);
* DAPO dynamic sampling draws at most ``MAX_SAMPLING_ROUNDS`` prompt batches per step and then
  trains on the groups it has (verl raises after ``max_num_gen_batches``);
* the LR schedule and warm-up count rollout steps, not optimizer steps;
* the ERA-style entropy floor is our reading of ERA's abstract, not its published activation;
* logged ``entropy`` is the mean over all completion tokens of the batch (not the loss mask);
* one process only: under MPI with two or more ranks the recipe refuses to start;
* ``data.selection: greso`` refills each round to ``prompts_per_step`` instead of GRESO's
  adaptive over-sampling; ``data.hints`` uses reference-solution prefixes as Scaf-GRPO's tiers
  (docs/informative-prompts.md);
* ``grpo.prime`` (PRIME) swaps the variant's group advantages for token advantages from an
  implicit PRM; its own deviations are listed in essa/gradient/prime.py;
* ``grpo.prm_credit: step`` adds each token's PRM step value minus the whole completion's to
  the group advantage (our form of PURE's min-form credit; essa/gradient/prm_credit.py), not
  PURE's own advantage estimator.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from essa import seeding
from essa.config import Config, to_dict
from essa.dist import Comm
from essa.errors import UserError
from essa.gradient import cure, losses, replay
from essa.gradient.policy import Policy, Rollout, merge, rollout, select, token_logprobs
from essa.gradient.prm_credit import step_credit
from essa.harness import Harness, Phase
from essa.rewards.base import DRAW_KEYS, DrawKey, Reward, score
from essa.rundir import atomic_dir, recover, storage_error
from essa.types import Example

if TYPE_CHECKING:
    from essa.data.selection import Informative
    from essa.data.task import Task
    from essa.gradient.prime import ImplicitPRM

MAX_SAMPLING_ROUNDS = 4  # prompt batches drawn per step at most when groups are filtered


def run(
    cfg: Config,
    run_dir: Path,
    *,
    resume: bool = False,
    console: Any = None,
    comm: Comm | None = None,
) -> dict[str, Any]:
    """Train with the configured GRPO variant; return the summary (also in summary.json)."""
    from essa import setup
    from essa.backends.memory import model_bytes
    from essa.data.task import load_task
    from essa.rewards.loading import load_reward

    h = setup.one_process_harness(cfg, run_dir, resume=resume, console=console, comm=comm)
    g = cfg.grpo
    variant = losses.get_variant(g.loss)
    setup.seed_everything(cfg.run.seed)
    task = load_task(cfg.data, cfg.run.seed)
    h.check_heldout(task.test)  # before the model loads
    # Group rewards work as is: each prompt's G completions come in one call.
    reward = load_reward(
        cfg.reward, recipe="GRPO", groups=True, provides=frozenset({DRAW_KEYS}), deadline=False
    )
    if g.replay.capacity and reward.is_group:
        raise UserError(
            f"grpo.replay: replays verified successes, but reward {cfg.reward.name} is a group "
            "reward (its score depends on the other completions); use a verifiable reward"
        )
    with h:  # the trackers close whatever happens
        model, tokenizer = setup.load_base_model(cfg, h)
        cfg, _ = setup.resolve_lengths(cfg, tokenizer, task, h.say)
        base_bytes = model_bytes(model)  # the base weights as stored, as ESSA reports them
        peft_model, sft_dir = setup.load_or_train_adapter(
            cfg, model, tokenizer, task, run_dir, h.reporter
        )
        policy = Policy.build(peft_model, g.trainable, cfg.adapter.alpha, _beta(cfg) != 0.0)
        optimizer = _make_optimizer(cfg, policy)
        data = _Data.build(task, cfg, tokenizer)
        prime = _implicit_prm(cfg, policy)
        state = _load_checkpoint(run_dir, policy, optimizer) if resume else None
        if prime is not None and state is not None:
            prime.load(run_dir / "checkpoint", state)
        state = h.restore(state, done=state["step"] if state else 0)
        if state is None:
            state = _initial_state(cfg, h, policy, tokenizer, data)
            if g.replay.seed_file is not None:
                state["replay"] = _seed_replay(cfg, h, tokenizer, data, reward)
        state.setdefault("replay", [])  # checkpoints written before replay existed
        informative = _informative(cfg, tokenizer, state.get("informative"))
        h.say(
            f"GRPO ({g.loss}, trainable={g.trainable}): {policy.dim} parameters, "
            f"{g.prompts_per_step} prompts x G={g.group_size} per step, "
            f"held-out {h.metric_name} baseline {state['baseline_accuracy']:.3f}"
        )
        for step in h.steps(state["step"], show=_shown):
            record = train_step(
                cfg,
                variant,
                policy,
                optimizer,
                tokenizer,
                reward,
                data,
                state,
                step.progress,
                informative,
                prime,
            )
            if h.due(step.index, cfg.evaluation.every):
                record["heldout_accuracy"] = heldout_accuracy(
                    policy, tokenizer, data, cfg, h, generation=step.index
                )
            state.update(step=step.index + 1, elapsed=h.elapsed)
            step.finish(record, lambda: _save_checkpoint(run_dir, policy, optimizer, state, prime))
        state["model_bytes"] = base_bytes
        return _finish(cfg, h, policy, tokenizer, data, state, sft_dir)


def _initial_state(
    cfg: Config, h: Harness, policy: Policy, tokenizer: Any, data: _Data
) -> dict[str, Any]:
    """Fresh-run state and metrics.jsonl's baseline record: the SFT adapter's held-out score."""
    baseline = heldout_accuracy(policy, tokenizer, data, cfg, h, "held-out baseline", -1)
    h.log(
        {
            "generation": -1,
            "event": "baseline",
            "heldout_accuracy": baseline,
            "dim": policy.dim,
            "variant": _preset(cfg),
        }
    )
    return {"step": 0, "baseline_accuracy": baseline, "elapsed": 0.0, "history": {}, "replay": []}


def _seed_replay(cfg: Config, h: Harness, tokenizer: Any, data: _Data, reward: Reward) -> list[Any]:
    """The replay buffer seeded from ``grpo.replay.seed_file`` (RLEP's first phase), as JSON."""
    r = cfg.grpo.replay
    assert r.seed_file is not None
    answers = [e.answer for e in data.train]
    found, report = replay.seed_experiences(
        r.seed_file, tokenizer, data.train_prompts, answers, reward, r.min_reward
    )
    buffer = replay.ReplayBuffer(r.capacity, [])
    buffer.add(found)
    h.say(
        f"replay: seeded {len(buffer.entries)} verified completions from {r.seed_file} "
        f"({report.lines} lines: {report.unmatched} not training prompts of this run, "
        f"{report.failed} below min_reward {r.min_reward})"
    )
    return buffer.to_json()


def _beta(cfg: Config) -> float:
    """The KL coefficient in force: the config's, else the variant preset's."""
    return losses.get_variant(cfg.grpo.loss).beta if cfg.grpo.beta is None else cfg.grpo.beta


def _implicit_prm(cfg: Config, policy: Policy) -> ImplicitPRM | None:
    """PRIME's implicit PRM (grpo.prime; essa/gradient/prime.py), None when off."""
    from essa.gradient.prime import ImplicitPRM

    return ImplicitPRM.build(cfg, policy)


def _make_optimizer(cfg: Config, policy: Policy) -> Any:
    """AdamW over the trainables, or LISA's AdamW that owns its layer groups."""
    g = cfg.grpo
    if g.trainable != "lisa":
        return torch.optim.AdamW(policy.params, lr=g.lr, weight_decay=g.weight_decay)
    from essa.gradient.lisa import LisaOptimizer

    return LisaOptimizer(
        policy.model,
        active_layers=g.lisa.active_layers,
        interval=g.lisa.interval,
        seed=cfg.run.seed,
        lr=g.lr,
        weight_decay=g.weight_decay,
        train_embeddings=g.lisa.train_embeddings,
        train_head=g.lisa.train_head,
        config_key="grpo.lisa",
    )


# ---------------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True)
class _Data:
    train: list[Example]
    train_prompts: list[str]
    test: list[Example]
    test_prompts: list[str]

    @classmethod
    def build(cls, task: Task, cfg: Config, tokenizer: Any) -> _Data:
        from essa.data.task import render_splits

        train_prompts, test_prompts = render_splits(task, cfg.data, tokenizer)
        n = cfg.grpo.train_examples  # 1-shot RLVR: the first training prompt only
        return cls(task.train[:n], train_prompts[:n], task.test, test_prompts)


def _informative(cfg: Config, tokenizer: Any, state: dict[str, Any] | None) -> Informative | None:
    """The per-prompt history of data.selection / data.hints (None when both are off)."""
    from essa.data.selection import Informative
    from essa.data.task import render_prompts

    d = cfg.data

    def render(examples: list[Example]) -> list[str]:
        return render_prompts(examples, d.template, tokenizer, d.system_prompt)

    return Informative.build(d, cfg.run.seed, cfg.grpo.group_size, render, state)


# ---------------------------------------------------------------------------------------------
# One step


@dataclass
class _Groups:
    """The step's training batch: kept groups of G fresh completions and their replays."""

    rollouts: list[Rollout]
    rewards: list[torch.Tensor]  # (n_i, G + k) per round; NaN where a group has < k replays
    prompt_ids: list[int]  # stable training-set index of each kept group
    replays: list[list[replay.Experience]]  # each kept group's replayed successes (<= k)
    credit: list[torch.Tensor] = field(default_factory=list)  # (n_i*G, T_i): prm_credit step


def replay_count(cfg: Config) -> int:
    """k: replayed completions per group (0 without replay)."""
    r = cfg.grpo.replay
    return round(r.ratio * cfg.grpo.group_size) if r.capacity and r.ratio > 0 else 0


def _draw_prompts(cfg: Config, n_train: int, step: int, rounds: int) -> list[int]:
    """One round's prompt indices; a training set smaller than a step (1-shot) repeats."""
    g = cfg.grpo
    rng = seeding.rng(cfg.run.seed, "grpo.prompts", step, rounds)
    if g.train_examples is not None and n_train < g.prompts_per_step:
        return rng.choice(n_train, size=g.prompts_per_step, replace=True).tolist()
    return rng.choice(n_train, size=min(g.prompts_per_step, n_train), replace=False).tolist()


def sample_groups(
    cfg: Config,
    variant: losses.Variant,
    policy: Policy,
    tokenizer: Any,
    reward: Reward,
    data: _Data,
    step: int,
    round_bar: Callable[[int], Phase] | None = None,
    informative: Informative | None = None,
    buffer: replay.ReplayBuffer | None = None,
) -> tuple[_Groups, list[replay.Experience], dict[str, float]]:
    """Draw prompts, sample G completions each, score, add replays; resample when filtered.

    Returns the kept groups, the fresh verified successes (for the buffer) and the stats.
    With ``informative`` (data.selection / data.hints) each round's draw skips prompts
    predicted uninformative (refilled from the rest) and hinted prompts carry their hint.
    """
    g = cfg.grpo
    k = replay_count(cfg) if buffer is not None else 0
    temperature = temperature_at(step, cfg)
    kept = _Groups([], [], [], [])
    found: list[replay.Experience] = []
    sampled_rewards: list[torch.Tensor] = []
    new_tokens = 0
    rounds = 0
    cure_tally = cure.Tally()
    sample = cure.branching(cure_tally) if cure.is_active(g.cure, step) else rollout
    while rounds < MAX_SAMPLING_ROUNDS and len(kept.prompt_ids) < g.prompts_per_step:
        idx = _draw_prompts(cfg, len(data.train), step, rounds)
        if informative is None:
            texts = [data.train_prompts[i] for i in idx]
        else:
            idx = informative.draw(idx, len(data.train), (step, rounds))
            texts = informative.prompts(idx, data.train, data.train_prompts)
        prompts = [text for text in texts for _ in range(g.group_size)]
        answers = [data.train[i].answer for i in idx for _ in range(g.group_size)]
        seed = seeding.seed_int(cfg.run.seed, "grpo.sampling", step, rounds)
        if round_bar is None:
            out = sample(policy, tokenizer, prompts, cfg, seed, temperature=temperature)
        else:
            with round_bar(len(prompts)) as bar:
                out = sample(policy, tokenizer, prompts, cfg, seed, bar.advance, temperature)
        # draw keys: (seed, step, round, prompt i of the round, sample j), row-major like out
        keys = [
            (cfg.run.seed, step, rounds, i, j) for i in range(len(idx)) for j in range(g.group_size)
        ]
        rewards = _score(cfg, reward, out, answers, prompts, keys)  # (B,)
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
            rng = seeding.rng(cfg.run.seed, "grpo.replay", step, rounds)
            replays = buffer.draw(idx, k, rng)
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
    }
    return kept, found, stats


def _score(
    cfg: Config,
    reward: Reward,
    out: Rollout,
    answers: list[str | None],
    prompts: list[str],
    keys: Sequence[DrawKey],
) -> torch.Tensor:
    """(B,) rewards of a round, NaN where ungradable, plus DAPO's overlong shaping when on."""
    scores = score(reward, out.texts, answers, prompts, keys)
    rewards = torch.tensor([math.nan if s is None else float(s) for s in scores])  # (B,)
    if cfg.grpo.overlong_buffer:
        lengths = out.mask.sum(-1)  # (B,)
        max_length = cfg.generation.new_tokens
        rewards = rewards + losses.soft_overlong_punishment(
            lengths, max_length, cfg.grpo.overlong_buffer
        )
    return rewards


def _training_batch(
    groups: _Groups, data: _Data, tokenizer: Any, group_size: int
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


def train_step(
    cfg: Config,
    variant: losses.Variant,
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    tokenizer: Any,
    reward: Reward,
    data: _Data,
    state: dict[str, Any],
    round_bar: Callable[[int], Phase] | None = None,
    informative: Informative | None = None,
    prime: ImplicitPRM | None = None,
) -> dict[str, Any]:
    """Sample, score, form advantages and update; returns the step's metrics record.

    ``round_bar(n)`` opens the progress bar of a sampling round of n completions. With
    replay, ``state["replay"]`` (the buffer, JSON) is read and updated.
    """
    g = cfg.grpo
    step = state["step"]
    start = time.perf_counter()
    buffer = None
    if g.replay.capacity:
        buffer = replay.ReplayBuffer.from_json(g.replay.capacity, state["replay"])
    groups, found, stats = sample_groups(
        cfg, variant, policy, tokenizer, reward, data, step, round_bar, informative, buffer
    )
    record: dict[str, Any] = {"generation": step, **stats}
    if informative is not None:  # prompts_skipped, rows_saved, prompts_hinted, ...
        record.update(informative.end_step())
        state["informative"] = informative.state_dict()
    if buffer is not None:
        record["replayed"] = sum(len(r) for r in groups.replays)
        record["replay_added"] = buffer.add(found)  # after drawing: replays are from past steps
        record["replay_buffer_size"] = len(buffer.entries)
        state["replay"] = buffer.to_json()
    if not groups.prompt_ids:  # every group was filtered away: nothing to learn from
        record.update(seconds=round(time.perf_counter() - start, 4), skipped=True)
        return record
    batch, group_index, slot = _training_batch(groups, data, tokenizer, g.group_size)
    history = _history_from_json(state["history"])
    adv, history = losses.advantages(variant, torch.cat(groups.rewards), groups.prompt_ids, history)
    state["history"] = _history_to_json(history)
    values = adv.values[group_index, slot]  # (B,)
    if groups.credit:  # grpo.prm_credit: step (no replays): A_i + w_p (G_k(t) - G_1), (B, T)
        width = batch.mask.shape[1]
        credit = torch.cat(
            [torch.nn.functional.pad(c, (0, width - c.shape[1])) for c in groups.credit]
        )
        values = values[:, None] + credit
        tokens = batch.mask.sum().clamp(min=1)  # how far the step credit moved the advantages
        record["prm_step_credit"] = float((credit.abs() * batch.mask).sum() / tokens)
    mask = batch.mask * adv.keep[group_index, slot][:, None]  # (B, T)
    if variant.use_truncation_mask:
        mask = mask * ~batch.truncated[:, None]  # overlong filtering (spec §5.4a)
    counts = losses.step_counts(mask, group_index, cfg.generation.new_tokens)
    for param_group in optimizer.param_groups:
        param_group["lr"] = g.lr * lr_factor(step, cfg)
    if prime is not None:  # PRIME: token advantages (B, T) from the implicit PRM, which learns
        values, prime_stats = prime.step(policy, batch, torch.cat(groups.rewards), cfg)
        record.update(prime_stats)
        state["prime"] = prime.state()
    updates = _update(cfg, variant, policy, optimizer, batch, values, mask, counts, step)
    fresh = len(groups.prompt_ids) * g.group_size  # the first rows; replays follow
    lengths = batch.mask[:fresh].sum(-1)
    seconds = time.perf_counter() - start
    record.update(updates)
    record.update(
        completion_length=float(lengths.mean()),
        truncated_fraction=float(batch.truncated[:fresh].float().mean()),
        lr=optimizer.param_groups[0]["lr"],
        seconds=round(seconds, 4),
        tokens_per_second=round(record["new_tokens"] / seconds, 1) if seconds > 0 else None,
    )
    return record


def _update(
    cfg: Config,
    variant: losses.Variant,
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    batch: Rollout,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    counts: losses.Counts,
    step: int,
) -> dict[str, float]:
    """``num_iterations`` AdamW steps on the batch, each accumulated over micro-batches.

    The loss is the variant's surrogate, minus ``grpo.entropy.coef`` times the mean token
    entropy over every completion token of the batch (``batch.mask``, not the loss mask).
    """
    g = cfg.grpo
    beta = variant.beta if g.beta is None else g.beta
    t = batch.completion_ids.shape[1]
    chunks = [c for c in torch.arange(mask.shape[0]).chunk(g.grad_accumulation) if c.numel()]
    temperature = temperature_at(step, cfg)  # log-probs of the distribution that sampled
    completion_tokens = int(batch.mask.sum())
    use_bonus = g.entropy.coef != 0.0

    def logprobs(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, attention = batch.input_ids[rows], batch.attention_mask[rows]
        return token_logprobs(
            policy.model, ids, attention, t, temperature, g.entropy.floor, use_bonus
        )

    with torch.no_grad():
        old_logp = torch.cat([logprobs(c)[0] for c in chunks]) if g.num_iterations > 1 else None
        ref_logp = None
        if beta != 0.0:
            with policy.frozen_reference():
                ref_logp = torch.cat([logprobs(c)[0] for c in chunks])  # (B, T)
    totals: dict[str, float] = {}
    for _ in range(g.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        totals = {"loss": 0.0, "kl": 0.0, "clip_low": 0.0, "clip_high": 0.0, "entropy": 0.0}
        for rows in chunks:
            logp, entropy = logprobs(rows)  # (b, T)
            old = logp.detach() if old_logp is None else old_logp[rows]
            loss, token = losses.policy_loss(
                variant,
                logp,
                old,
                advantages[rows],
                mask[rows],
                counts._replace(group_tokens=counts.group_tokens[rows]),
                ref_logp=None if ref_logp is None else ref_logp[rows],
                beta=beta,
                epsilon_low=g.epsilon_low,
                epsilon_high=g.epsilon_high,
            )
            if use_bonus:
                loss = loss + losses.entropy_bonus(
                    entropy, batch.mask[rows], completion_tokens, g.entropy.coef
                )
            loss.backward()
            _accumulate(totals, loss, token, advantages[rows], mask[rows], counts)
            totals["entropy"] += float((entropy.detach() * batch.mask[rows]).sum()) / max(
                completion_tokens, 1
            )
        norm = _clip_gradients(policy.params, g.max_grad_norm)
        optimizer.step()
    return {**totals, "grad_norm": norm}


def _accumulate(
    totals: dict[str, float],
    loss: torch.Tensor,
    token: losses.TokenLoss,
    advantages: torch.Tensor,
    mask: torch.Tensor,
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


def _clip_gradients(params: list[torch.Tensor], max_norm: float) -> float:
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    grads = [p.grad.flatten() for p in params if p.grad is not None]
    return float(torch.cat(grads).norm()) if grads else 0.0


def temperature_at(step: int, cfg: Config) -> float:
    """The rollout temperature of ``step``: the last schedule stage started, else the base.

    A pure function of the step, so a resumed run is at the same stage.

    >>> from essa.config import GRPOConfig
    >>> cfg = Config(grpo=GRPOConfig(temperature=0.6, temperature_schedule=((2, 0.8), (5, 1.0))))
    >>> [temperature_at(s, cfg) for s in (0, 1, 2, 4, 5, 9)]
    [0.6, 0.6, 0.8, 0.8, 1.0, 1.0]
    """
    temperature = cfg.grpo.temperature
    for start, value in cfg.grpo.temperature_schedule:
        if step >= start:
            temperature = value
    return temperature


def lr_factor(step: int, cfg: Config) -> float:
    """Linear warm-up over ``lr_warmup_steps`` rollout steps, then constant/cosine/linear."""
    g = cfg.grpo
    if step < g.lr_warmup_steps:
        return (step + 1) / g.lr_warmup_steps
    frac = min(1.0, (step - g.lr_warmup_steps) / max(1, cfg.run.generations - g.lr_warmup_steps))
    if g.lr_schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * frac))
    if g.lr_schedule == "linear":
        return 1.0 - frac
    return 1.0


def heldout_accuracy(
    policy: Policy,
    tokenizer: Any,
    data: _Data,
    cfg: Config,
    h: Harness,
    name: str = "held-out",
    generation: int | None = None,
    *,
    final: bool = False,
) -> float:
    """Greedy held-out score (``evaluation.metric``) on the fixed test split, as ESSA's.

    With ``generation`` its first items are also samples (:meth:`Harness.score`).
    """
    from dataclasses import replace

    from essa.backends.generate import generate_texts

    if not data.test:
        return float("nan")
    with policy.inference(), h.phase(name, len(data.test), unit="rows") as bar:
        texts, _ = generate_texts(
            policy.model,
            tokenizer,
            data.test_prompts,
            replace(cfg.generation, temperature=0.0),  # the groups sample; the score is greedy
            micro_batch_size=cfg.evaluation.micro_batch_size,
            progress=bar.advance,
        )
    return h.score(texts, data.test, data.test_prompts, generation, final=final)


# ---------------------------------------------------------------------------------------------
# Checkpoint, summary, messages


def _history_to_json(history: dict[int, losses.PromptStats]) -> dict[str, list[float]]:
    return {str(k): [v.visits, v.mean, v.var] for k, v in history.items()}


def _history_from_json(data: dict[str, list[float]]) -> dict[int, losses.PromptStats]:
    return {int(k): losses.PromptStats(int(v[0]), v[1], v[2]) for k, v in data.items()}


def _save_checkpoint(
    run_dir: Path,
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    prime: ImplicitPRM | None = None,
) -> None:
    """RUN_DIR/checkpoint/: state.json and tensors.safetensors (trainables, AdamW moments).

    Replaced atomically; on a failed write (full disk) the previous checkpoint stays and
    :class:`StorageError` names the directory.
    """
    from safetensors.torch import save_file

    from essa.faults import checkpoint_fault

    tensors: dict[str, torch.Tensor] = {}
    adam_steps = []
    for i, param in enumerate(policy.params):
        tensors[f"param.{i}"] = param.detach().cpu().contiguous()
        moments = optimizer.state.get(param, {})
        if moments:
            tensors[f"exp_avg.{i}"] = moments["exp_avg"].cpu().contiguous()
            tensors[f"exp_avg_sq.{i}"] = moments["exp_avg_sq"].cpu().contiguous()
        adam_steps.append(float(moments["step"]) if moments else 0.0)
    if prime is not None:  # PRIME's implicit PRM and its moments
        tensors.update(prime.tensors())
    steps = {"adam_steps": adam_steps, "lisa_steps": getattr(optimizer, "steps", None)}
    fault = checkpoint_fault(state["step"])  # None unless ESSA_FAULT is set (tests)
    try:
        with atomic_dir(run_dir / "checkpoint") as tmp:
            save_file(tensors, str(tmp / "tensors.safetensors"))
            (tmp / "state.json").write_text(json.dumps({**state, **steps}))
            if fault is not None:
                fault()
    except OSError as err:
        raise storage_error(run_dir / "checkpoint", err) from None


def _load_checkpoint(
    run_dir: Path, policy: Policy, optimizer: torch.optim.Optimizer
) -> dict[str, Any] | None:
    from safetensors.torch import load_file

    recover(run_dir / "checkpoint")
    path = run_dir / "checkpoint"
    if not (path / "state.json").exists():
        return None
    state = json.loads((path / "state.json").read_text())
    tensors = load_file(str(path / "tensors.safetensors"))
    adam_steps = state.pop("adam_steps")
    if len(adam_steps) != len(policy.params):
        raise UserError(f"--resume {run_dir}: the checkpoint does not match this model/adapter")
    lisa_steps = state.pop("lisa_steps", None)
    if lisa_steps is not None:  # LISA: reactivate the saved interval's blocks before moments
        optimizer.restore(lisa_steps)  # type: ignore[attr-defined]
    with torch.no_grad():
        for i, param in enumerate(policy.params):
            param.copy_(tensors[f"param.{i}"])
            if f"exp_avg.{i}" in tensors:
                device = param.device
                optimizer.state[param] = {
                    "step": torch.tensor(adam_steps[i]),
                    "exp_avg": tensors[f"exp_avg.{i}"].to(device),
                    "exp_avg_sq": tensors[f"exp_avg_sq.{i}"].to(device),
                }
    return state


def _preset(cfg: Config) -> dict[str, Any]:
    """The variant preset with this run's overrides applied: logged so numbers say what ran."""
    variant = losses.get_variant(cfg.grpo.loss)
    preset = {k: v for k, v in vars(variant).items()}
    for key in ("beta", "epsilon_low", "epsilon_high"):
        value = getattr(cfg.grpo, key)
        if value is not None:
            preset[key] = value
    return preset


def _finish(
    cfg: Config,
    h: Harness,
    policy: Policy,
    tokenizer: Any,
    data: _Data,
    state: dict[str, Any],
    sft_dir: str,
) -> dict[str, Any]:
    """Evaluate the final policy on the held-out split, export it, write the summary."""
    from essa.backends.memory import memory_metrics

    g = cfg.grpo
    final = heldout_accuracy(
        policy, tokenizer, data, cfg, h, "final held-out", state["step"], final=True
    )
    report = _drift(cfg, h, policy, tokenizer, data)
    adapter_dir = h.run_dir / "adapter"
    with h.phase("export"):
        policy.export(adapter_dir, cfg.model.name_or_path)
        if g.replay.capacity and h.is_root:
            buffer = replay.ReplayBuffer.from_json(g.replay.capacity, state["replay"])
            replay.write_buffer(h.run_dir / "replay.jsonl", buffer, data.train_prompts)
    summary = h.summary(
        baseline=state["baseline_accuracy"],
        final=final,
        steps=state["step"],
        adapter_dir=adapter_dir,
        algorithm="grpo",
        loss=g.loss,
        trainable=g.trainable,
        sft_adapter_dir=str(Path(sft_dir).resolve()),  # absolute: the run may start elsewhere
        selected="final",
        scale_baseline=None,
        scale_baseline_ran=False,  # GRPO has no no-search baseline
        dim=policy.dim,
        test_size=len(data.test),
        variant=_preset(cfg),
        grpo=to_dict(g),
        drift=report,
        **memory_metrics(state["model_bytes"]),
    )
    return h.finish(summary)


def _drift(cfg: Config, h: Harness, policy: Policy, tokenizer: Any, data: _Data) -> dict[str, Any]:
    """The final policy's drift report (essa/drift.py). LISA trains the base weights (the SFT
    adapter merged in), so it has neither a base nor an adapter to compare: pass@K and
    retention of the tuned model only."""
    from essa import drift

    lisa = cfg.grpo.trainable == "lisa"
    sft = None if lisa else policy.frozen_reference
    models = drift.PeftModels(
        policy.model, tokenizer, cfg.evaluation.micro_batch_size, sft=sft, has_base=not lisa
    )
    updates = None if lisa else drift.peft_updates(policy.model, sft)
    # Not under policy.inference(): its cached factors would outlive frozen_reference's swap.
    with h.phase("drift"):
        report = drift.measure(cfg, models, tokenizer, data.test, h.metric, updates)
    line = drift.summary_line(report)
    if line is not None:
        h.say(line)
    return report


def _shown(record: dict[str, Any]) -> dict[str, Any]:
    """The loop's console fields."""
    shown = {"reward": record["mean_reward"], "loss": record.get("loss")}
    if "heldout_accuracy" in record:
        shown["held-out"] = record["heldout_accuracy"]
    return shown
