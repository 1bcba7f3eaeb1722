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
Formulas and presets, with their papers: essa/gradient/losses.py. The options that act while
sampling (DAPO re-sampling, CURE, replay, informative prompts, PRM step credit) plug in through
essa/gradient/sampling.py. The step's optional features plug in through three hooks
(essa/gradient/hooks.py): what is sampled (replay, informative prompts), how advantages are made
(after the group-normalised outcome advantages: PRM step credit, PRIME) and what the loss masks
(the truncation mask, SimpleTIR's void turns); the update itself is essa/gradient/update.py.
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
* DAPO dynamic sampling draws at most ``MAX_SAMPLING_ROUNDS`` (essa/gradient/sampling.py)
  prompt batches per step and then trains on the groups it has (verl raises after
  ``max_num_gen_batches``);
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

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from essa.config import Config, to_dict
from essa.dist import Comm
from essa.errors import UserError
from essa.gradient import checkpoint, losses, replay
from essa.gradient.data import TaskData
from essa.gradient.drift import PolicyDrift
from essa.gradient.features import grpo_hooks
from essa.gradient.heldout import baseline_state, heldout_accuracy
from essa.gradient.hooks import Hooks
from essa.gradient.optim import make_optimizer
from essa.gradient.outcome import outcome_advantages
from essa.gradient.policy import Policy, Rollout, Sampling
from essa.gradient.sampling import sample_groups, step_batch
from essa.gradient.schedule import lr_factor, set_lr
from essa.gradient.update import policy_update
from essa.harness import Harness, Phase
from essa.rewards.base import DRAW_KEYS, Reward
from essa.setup import drift_settings
from essa.tools.turns import ToolTally

if TYPE_CHECKING:
    from essa.gradient.optim import Optimizer


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
    from essa.gradient.prime import ImplicitPRM

    h, task = setup.open_run(cfg, run_dir, resume=resume, console=console, comm=comm, gradient=True)
    g = cfg.grpo
    variant = losses.get_variant(g.loss)
    reward = _reward(cfg)
    with h:  # the trackers close whatever happens
        cfg, model, tokenizer, base_bytes, _ = setup.open_model(cfg, h, task)
        peft_model, sft_dir = setup.load_or_train_adapter(
            cfg, model, tokenizer, task, run_dir, h.reporter
        )
        beta = losses.beta(g)
        policy = Policy.build(peft_model, g.trainable, cfg.adapter.alpha, beta != 0.0)
        optimizer = make_optimizer(policy, g, cfg.run.seed, "grpo")
        data = TaskData.build(task, cfg.data, tokenizer, g.train_examples)
        prime = ImplicitPRM.build(g, policy)  # grpo.prime (essa/gradient/prime.py); None: off
        trained = [checkpoint.Trained("policy", policy.params, optimizer)]
        trained += [] if prime is None else [prime.trained()]  # phi, before the checkpoint loads
        state = checkpoint.load(run_dir, trained) if resume else None
        state = h.restore(state, done=state["step"] if state else 0)
        drift = _drift(cfg)
        warmed = drift.warm(h, policy, tokenizer, data.test)  # what training cannot change, first
        if state is None:
            fields = {"dim": policy.dim, "variant": losses.preset(g)}
            ev = (cfg.generation, cfg.evaluation.micro_batch_size)
            state = baseline_state(policy, tokenizer, data, h, *ev, fields, cfg.tools.python)
            state["end_reserve"] = drift.reserve(h, warmed, len(data.test))
            first = replay.first_buffer(
                g.replay, tokenizer, data.train, data.train_prompts, reward, h.say
            )
            state.update(history={}, replay=first)
        hooks = grpo_hooks(
            g, cfg.data, cfg.tools.python, cfg.run.seed, variant, policy, tokenizer, state, prime
        )
        h.say(
            f"GRPO ({g.loss}, trainable={g.trainable}): {policy.dim} parameters, "
            f"{g.prompts_per_step} prompts x G={g.group_size} per step, "
            f"held-out {h.metric_name} baseline {state['baseline_accuracy']:.3f}"
        )
        for step in h.steps(state["step"], show=_shown):
            record = train_step(
                cfg, variant, policy, optimizer, tokenizer, reward, data, state, hooks,
                step.progress,
            )  # fmt: skip
            if h.due(step.index, cfg.evaluation.every):
                record.update(_heldout_pass(cfg, policy, tokenizer, data, h, step.index))
            state.update(step=step.index + 1, elapsed=h.elapsed)
            step.finish(record, lambda: checkpoint.save(run_dir, trained, state))
        state["model_bytes"] = base_bytes
        return _finish(cfg, h, policy, tokenizer, data, state, sft_dir)


def _reward(cfg: Config) -> Reward:
    """The run's reward; group rewards work as is: each prompt's G completions come in one call."""
    from essa.rewards.loading import load_reward

    reward = load_reward(
        cfg.reward, recipe="GRPO", groups=True, provides=frozenset({DRAW_KEYS}), deadline=False
    )
    if cfg.grpo.replay.capacity and reward.is_group:
        raise UserError(
            f"grpo.replay: replays verified successes, but reward {cfg.reward.name} is a group "
            "reward (its score depends on the other completions); use a verifiable reward"
        )
    return reward


def _heldout_pass(
    cfg: Config, policy: Policy, tokenizer: Any, data: TaskData, h: Harness, step: int
) -> dict[str, Any]:
    """One held-out pass during training: accuracy, the tools' tallies, the drift figures."""
    tally = ToolTally()
    record: dict[str, Any] = {}
    record["heldout_accuracy"] = heldout_accuracy(
        policy, tokenizer, data, h, cfg.generation, cfg.evaluation.micro_batch_size, step=step,
        tools=cfg.tools.python, tally=tally,
    )  # fmt: skip
    if cfg.tools.python.max_tool_calls:
        record.update({"heldout_" + k: v for k, v in tally.metrics().items()})
    if cfg.evaluation.drift.every_pass:
        record.update(_drift(cfg).pass_figures(policy, tokenizer))
    return record


# ---------------------------------------------------------------------------------------------
# One step


def train_step(
    cfg: Config,
    variant: losses.Variant,
    policy: Policy,
    optimizer: Optimizer,
    tokenizer: Any,
    reward: Reward,
    data: TaskData,
    state: dict[str, Any],
    hooks: Hooks,
    round_bar: Callable[[int], Phase] | None = None,
) -> dict[str, Any]:
    """Sample, score, form advantages and update; returns the step's metrics record.

    ``hooks`` plug in the optional features; ``round_bar(n)`` opens a sampling round's bar."""
    g, step, start = cfg.grpo, state["step"], time.perf_counter()
    sampling = Sampling.for_grpo(
        g, cfg.generation, cfg.evaluation.micro_batch_size, cfg.tools.python
    )
    groups, found, stats = sample_groups(
        g, sampling, cfg.run.seed, variant, policy, tokenizer, reward, data, step,
        round_bar, *hooks.sources(),
    )  # fmt: skip
    record = {"generation": step, **stats, **hooks.sampled(groups.replays, found, state)}
    if not groups.prompt_ids:  # every group was filtered away: nothing to learn from
        return {**record, "seconds": round(time.perf_counter() - start, 4), "skipped": True}
    rows = step_batch(groups, data, tokenizer, g.group_size)
    adv, made = hooks.made(outcome_advantages(variant, rows, state), rows)  # (B,) or (B, T)
    mask, masked = hooks.loss_mask(rows.rollout, adv.keep)  # (B, T)
    counts = losses.step_counts(mask, rows.group_index, cfg.generation.new_tokens)
    factor = lr_factor(step, cfg.run.generations, g.lr_warmup_steps, g.lr_schedule)
    set_lr(optimizer.param_groups, g.lr * factor)
    record.update(made | masked)
    record.update(
        policy_update(g, variant, policy, optimizer, rows.rollout, adv.values, mask, counts, step)
    )
    fresh = len(groups.prompt_ids) * g.group_size  # the first rows; replays follow
    return {**record, **_throughput(rows.rollout, fresh, optimizer, record["new_tokens"], start)}


def _throughput(
    batch: Rollout, fresh: int, optimizer: Optimizer, new_tokens: int, start: float
) -> dict[str, Any]:
    """The step's lengths (over its ``fresh`` rows: the policy's own), lr and speed."""
    seconds = time.perf_counter() - start
    return {
        "completion_length": float(batch.mask[:fresh].sum(-1).mean()),
        "truncated_fraction": float(batch.truncated[:fresh].float().mean()),
        "lr": optimizer.param_groups[0]["lr"],
        "seconds": round(seconds, 4),
        "tokens_per_second": round(new_tokens / seconds, 1) if seconds > 0 else None,
    }


# ---------------------------------------------------------------------------------------------
# Summary


def _finish(
    cfg: Config,
    h: Harness,
    policy: Policy,
    tokenizer: Any,
    data: TaskData,
    state: dict[str, Any],
    sft_dir: str,
) -> dict[str, Any]:
    """Evaluate the final policy on the held-out split, export it, write the summary."""
    from essa.backends.memory import memory_metrics

    g = cfg.grpo
    tally = ToolTally()
    final = heldout_accuracy(
        policy, tokenizer, data, h, cfg.generation, cfg.evaluation.micro_batch_size,
        "final held-out", state["step"], final=True, tools=cfg.tools.python, tally=tally,
    )  # fmt: skip
    report = _drift(cfg).report(h, policy, tokenizer, data.test)
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
        variant=losses.preset(g),
        grpo=to_dict(g),
        **({"tools": tally.metrics()} if cfg.tools.python.max_tool_calls else {}),
        drift=report,
        **memory_metrics(state["model_bytes"]),
    )
    return h.finish(summary)


def _drift(cfg: Config) -> PolicyDrift:
    """The run's drift report: LISA's has neither base nor adapter to compare."""
    return PolicyDrift(drift_settings(cfg), lisa=cfg.grpo.trainable == "lisa")


def _shown(record: dict[str, Any]) -> dict[str, Any]:
    """The loop's console fields."""
    shown = {"reward": record["mean_reward"], "loss": record.get("loss")}
    if "heldout_accuracy" in record:
        shown["held-out"] = record["heldout_accuracy"]
    return shown
