"""DPO (Rafailov et al., arXiv 2305.18290) on the same task, model and SFT adapter as ESSA/GRPO.

As InfiAlign and SuperCorrect use it after SFT: the frozen reference is the SFT adapter, and the
policy starts there. The loop, per step: take ``dpo.pairs_per_step`` pairs, from the
``dpo.pairs`` file (a seeded draw without replacement) or online (draw that many training
prompts, sample ``dpo.samples_per_prompt`` completions of each at ``dpo.temperature``, score
them with the configured reward and pair the best with the worst, the common RLVR-to-DPO
recipe); one forward of policy and reference over the 2n sequences; one AdamW step on the
loss (:func:`dpo_loss`); log and checkpoint. Held-out accuracy is greedy on the fixed test
split, every ``evaluation.every`` steps, as in GRPO. Formulas: docs/dpo-scalebio.md.

Trainable sets (``dpo.trainable``): ``lora`` continues the SFT adapter's LoRA factors; ``lisa``
merges the SFT LoRA and trains the base weights with LISA (essa/gradient/lisa.py), the reference
being a frozen copy of the merged weights. Both reuse GRPO's :class:`Policy`.

Deviations from the paper and project choices:
* sequence log-probs are sums over the completion tokens up to and including EOS (as TRL);
  logits are not divided by the sampling temperature (the reference is the plain policy);
* online pairs: chosen = the first highest-reward sample, rejected = the first lowest, kept
  only when the two rewards differ; a step with no pair is logged and skipped (no resampling);
* one optimizer step per step on the whole batch (no micro-batches, no epochs over a dataset);
* label smoothing is cDPO's (Mitchell 2023), which TRL 1.16's ``sigmoid`` no longer has;
* one process only: under MPI with two or more ranks the recipe refuses to start.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from essa import seeding
from essa.config import Config, DPOConfig, to_dict
from essa.dist import Comm
from essa.errors import UserError
from essa.gradient.policy import Policy, Rollout, rollout, select, token_logprobs
from essa.harness import Harness, Phase
from essa.recipes import grpo
from essa.rewards.base import DRAW_KEYS, Reward, score
from essa.types import Example, PreferencePair

if TYPE_CHECKING:
    from essa.gradient.lisa import LisaOptimizer


def run(
    cfg: Config,
    run_dir: Path,
    *,
    resume: bool = False,
    console: Any = None,
    comm: Comm | None = None,
) -> dict[str, Any]:
    """Train with DPO; return the summary (also in summary.json)."""
    from essa import setup
    from essa.backends.memory import model_bytes
    from essa.data.task import load_task, render_prompts
    from essa.rewards.loading import load_reward

    h = setup.one_process_harness(cfg, run_dir, resume=resume, console=console, comm=comm)
    d = cfg.dpo
    setup.seed_everything(cfg.run.seed)
    task = load_task(cfg.data, cfg.run.seed)
    h.check_heldout(task.test)  # before the model loads
    pairs = _load_pairs(d.pairs) if d.pairs else None
    reward = (
        None
        if pairs
        else load_reward(
            cfg.reward, recipe="DPO", groups=True, provides=frozenset({DRAW_KEYS}), deadline=False
        )
    )
    with h:
        model, tokenizer = setup.load_base_model(cfg, h)
        cfg, _ = setup.resolve_lengths(cfg, tokenizer, task, h.say)
        base_bytes = model_bytes(model)
        peft_model, sft_dir = setup.load_or_train_adapter(
            cfg, model, tokenizer, task, run_dir, h.reporter
        )
        policy = Policy.build(peft_model, d.trainable, cfg.adapter.alpha, use_reference=True)
        optimizer = _make_optimizer(cfg, policy)
        data = grpo._Data.build(task, cfg, tokenizer)
        pair_prompts = None
        if pairs is not None:
            questions = [Example(prompt=p.prompt) for p in pairs]
            pair_prompts = render_prompts(
                questions, cfg.data.template, tokenizer, cfg.data.system_prompt
            )
        state = grpo._load_checkpoint(run_dir, policy, optimizer) if resume else None
        state = h.restore(state, done=state["step"] if state else 0)
        if state is None:
            state = _initial_state(cfg, h, policy, tokenizer, data)
        source = f"{len(pairs)} pairs from {d.pairs}" if pairs else "online pairs"
        h.say(
            f"DPO ({d.loss}, beta {d.beta}, trainable={d.trainable}): {policy.dim} parameters, "
            f"{source}, {d.pairs_per_step} per step, "
            f"held-out {h.metric_name} baseline {state['baseline_accuracy']:.3f}"
        )
        for step in h.steps(state["step"], show=_shown):
            start = time.perf_counter()
            batch: Rollout | None
            if pairs is not None and pair_prompts is not None:
                batch, stats = file_batch(pairs, pair_prompts, tokenizer, cfg, step.index)
            else:
                assert reward is not None
                batch, stats = online_batch(
                    cfg, policy, tokenizer, reward, data, step.index, step.progress
                )
            record: dict[str, Any] = {"generation": step.index, **stats}
            record.update(train_step(cfg, policy, optimizer, batch, step.index))
            record["seconds"] = round(time.perf_counter() - start, 4)
            if h.due(step.index, cfg.evaluation.every):
                record["heldout_accuracy"] = grpo.heldout_accuracy(
                    policy, tokenizer, data, cfg, h, generation=step.index
                )
            state.update(step=step.index + 1, elapsed=h.elapsed)
            step.finish(record, lambda: grpo._save_checkpoint(run_dir, policy, optimizer, state))
        state["model_bytes"] = base_bytes
        return _finish(cfg, h, policy, tokenizer, data, state, sft_dir)


def _load_pairs(path: str) -> list[PreferencePair]:
    from essa.data import DataError
    from essa.data.loaders import load_preference_pairs

    try:
        return load_preference_pairs(path)
    except DataError as err:
        raise UserError(f"dpo.pairs: {err}") from None


def _initial_state(
    cfg: Config, h: Harness, policy: Policy, tokenizer: Any, data: grpo._Data
) -> dict[str, Any]:
    """Fresh-run state and metrics.jsonl's baseline record: the SFT adapter's held-out score."""
    baseline = grpo.heldout_accuracy(policy, tokenizer, data, cfg, h, "held-out baseline", -1)
    h.log(
        {
            "generation": -1,
            "event": "baseline",
            "heldout_accuracy": baseline,
            "dim": policy.dim,
            "dpo": to_dict(cfg.dpo),
        }
    )
    return {"step": 0, "baseline_accuracy": baseline, "elapsed": 0.0}


def _make_optimizer(cfg: Config, policy: Policy) -> Any:
    """AdamW over the LoRA factors, or LISA's AdamW that owns its layer groups (as GRPO)."""
    d = cfg.dpo
    if d.trainable != "lisa":
        return torch.optim.AdamW(policy.params, lr=d.lr, weight_decay=d.weight_decay)
    from essa.gradient.lisa import LisaOptimizer

    return LisaOptimizer(
        policy.model,
        active_layers=d.lisa.active_layers,
        interval=d.lisa.interval,
        seed=cfg.run.seed,
        lr=d.lr,
        weight_decay=d.weight_decay,
        train_embeddings=d.lisa.train_embeddings,
        train_head=d.lisa.train_head,
        config_key="dpo.lisa",
    )


# ---------------------------------------------------------------------------------------------
# The loss


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


def train_step(
    cfg: Config,
    policy: Policy,
    optimizer: torch.optim.Optimizer | LisaOptimizer,
    batch: Rollout | None,
    step: int,
) -> dict[str, Any]:
    """One AdamW step on the DPO loss of ``batch`` (rows: n chosen, then their n rejected)."""
    d = cfg.dpo
    if batch is None:  # no pair this step (online: every group had equal rewards)
        return {"skipped": True}
    for param_group in optimizer.param_groups:
        param_group["lr"] = d.lr * lr_factor(step, cfg)
    n = batch.input_ids.shape[0] // 2
    with torch.no_grad(), policy.frozen_reference():
        ref = sequence_logprobs(policy.model, batch)  # (2n,)
    optimizer.zero_grad(set_to_none=True)
    logp = sequence_logprobs(policy.model, batch)  # (2n,)
    tokens = batch.mask.sum(-1)  # (2n,)
    out = dpo_loss(logp[:n], logp[n:], ref[:n], ref[n:], d, tokens[:n], tokens[n:])
    out.loss.backward()
    norm = grpo._clip_gradients(policy.params, d.max_grad_norm)
    optimizer.step()
    margins = out.chosen_rewards - out.rejected_rewards  # (n,)
    return {
        "loss": float(out.loss.detach()),
        "reward_accuracy": float((margins > 0).float().mean()),
        "reward_margin": float(margins.mean()),
        "chosen_reward": float(out.chosen_rewards.mean()),
        "rejected_reward": float(out.rejected_rewards.mean()),
        "logp_chosen": float(logp[:n].detach().mean()),
        "logp_rejected": float(logp[n:].detach().mean()),
        "grad_norm": norm,
        "lr": optimizer.param_groups[0]["lr"],
    }


def lr_factor(step: int, cfg: Config) -> float:
    """1, or cosine from 1 to 0 over run.generations steps."""
    if cfg.dpo.lr_schedule == "constant":
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, step / max(1, cfg.run.generations))))


# ---------------------------------------------------------------------------------------------
# Pairs


def file_batch(
    pairs: Sequence[PreferencePair],
    prompts: Sequence[str],
    tokenizer: Any,
    cfg: Config,
    step: int,
) -> tuple[Rollout, dict[str, Any]]:
    """The step's pairs from the file: a draw without replacement seeded by (seed, step)."""
    rng = seeding.rng(cfg.run.seed, "dpo.file_pairs", step)
    idx = rng.choice(len(pairs), size=min(cfg.dpo.pairs_per_step, len(pairs)), replace=False)
    chosen = [pairs[i].chosen for i in idx.tolist()]
    rejected = [pairs[i].rejected for i in idx.tolist()]
    rows = [prompts[i] for i in idx.tolist()]
    return encode_pairs(tokenizer, rows, chosen, rejected), {"pairs": len(idx)}


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


def online_batch(
    cfg: Config,
    policy: Policy,
    tokenizer: Any,
    reward: Reward,
    data: grpo._Data,
    step: int,
    round_bar: Callable[[int], Phase],
) -> tuple[Rollout | None, dict[str, Any]]:
    """Sample k completions of the step's prompts, score, pair best with worst per prompt."""
    d = cfg.dpo
    k = d.samples_per_prompt
    rng = seeding.rng(cfg.run.seed, "dpo.prompts", step)
    idx = rng.choice(len(data.train), size=min(d.pairs_per_step, len(data.train)), replace=False)
    prompts = [data.train_prompts[i] for i in idx.tolist() for _ in range(k)]
    answers = [data.train[i].answer for i in idx.tolist() for _ in range(k)]
    seed = seeding.seed_int(cfg.run.seed, "dpo.sampling", step)
    with round_bar(len(prompts)) as bar:
        out = rollout(
            policy, tokenizer, prompts, cfg, seed, progress=bar.advance, temperature=d.temperature
        )
    keys = [(cfg.run.seed, step, i, j) for i in range(len(idx)) for j in range(k)]
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


# ---------------------------------------------------------------------------------------------
# Summary


def _finish(
    cfg: Config,
    h: Harness,
    policy: Policy,
    tokenizer: Any,
    data: grpo._Data,
    state: dict[str, Any],
    sft_dir: str,
) -> dict[str, Any]:
    """Evaluate the final policy on the held-out split, export it, write the summary."""
    from essa.backends.memory import memory_metrics

    d = cfg.dpo
    final = grpo.heldout_accuracy(
        policy, tokenizer, data, cfg, h, "final held-out", state["step"], final=True
    )
    adapter_dir = h.run_dir / "adapter"
    with h.phase("export"):
        policy.export(adapter_dir, cfg.model.name_or_path)
    summary = h.summary(
        baseline=state["baseline_accuracy"],
        final=final,
        steps=state["step"],
        adapter_dir=adapter_dir,
        algorithm="dpo",
        loss=d.loss,
        trainable=d.trainable,
        sft_adapter_dir=str(Path(sft_dir).resolve()),
        selected="final",
        scale_baseline=None,
        scale_baseline_ran=False,
        dim=policy.dim,
        test_size=len(data.test),
        dpo=to_dict(d),
        **memory_metrics(state["model_bytes"]),
    )
    return h.finish(summary)


def _shown(record: dict[str, Any]) -> dict[str, Any]:
    """The loop's console fields."""
    shown = {"loss": record.get("loss"), "pairs": record.get("pairs")}
    if "heldout_accuracy" in record:
        shown["held-out"] = record["heldout_accuracy"]
    return shown
