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
being a frozen copy of the merged weights. Both use the gradient toolkit's :class:`Policy`;
pairs and the loss are essa/gradient/preference.py.

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

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from essa.config import Config, DataConfig, DPOConfig, to_dict
from essa.dist import Comm
from essa.errors import UserError
from essa.gradient import checkpoint
from essa.gradient.data import TaskData
from essa.gradient.heldout import baseline_state, heldout_accuracy
from essa.gradient.optim import make_optimizer
from essa.gradient.policy import Policy, Rollout, Sampling
from essa.gradient.preference import dpo_loss, file_batch, online_batch, sequence_logprobs
from essa.gradient.schedule import clip_gradients, lr_factor
from essa.harness import Harness
from essa.rewards.base import DRAW_KEYS, Reward
from essa.types import Example, PreferencePair

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
    """Train with DPO; return the summary (also in summary.json)."""
    from essa import setup

    h, task = setup.open_run(cfg, run_dir, resume=resume, console=console, comm=comm, gradient=True)
    d = cfg.dpo
    pairs = _load_pairs(d.pairs) if d.pairs else None
    reward = None if pairs else _reward(cfg)
    with h:
        cfg, model, tokenizer, base_bytes, _ = setup.open_model(cfg, h, task)
        peft_model, sft_dir = setup.load_or_train_adapter(
            cfg, model, tokenizer, task, run_dir, h.reporter
        )
        policy = Policy.build(peft_model, d.trainable, cfg.adapter.alpha, use_reference=True)
        optimizer = make_optimizer(policy, d, cfg.run.seed, "dpo")
        trained = [checkpoint.Trained("policy", policy.params, optimizer)]
        data = TaskData.build(task, cfg.data, tokenizer, d.train_examples)
        pair_prompts = _pair_prompts(pairs, cfg.data, tokenizer)
        ev = (cfg.generation, cfg.evaluation.micro_batch_size)
        sampling = Sampling(*ev, d.temperature, d.entropy_floor)
        state = checkpoint.load(run_dir, trained) if resume else None
        state = h.restore(state, done=state["step"] if state else 0)
        if state is None:
            fields = {"dim": policy.dim, "dpo": to_dict(d)}
            state = baseline_state(policy, tokenizer, data, h, *ev, fields)
        h.say(_opening(d, policy.dim, pairs, h.metric_name, state["baseline_accuracy"]))
        for step in h.steps(state["step"], show=_shown):
            start = time.perf_counter()
            batch: Rollout | None
            if pairs is not None and pair_prompts is not None:
                batch, stats = file_batch(
                    pairs, pair_prompts, tokenizer, d, cfg.run.seed, step.index
                )
            else:  # pairs sampled from the policy and ranked by the reward
                assert reward is not None
                batch, stats = online_batch(
                    d, sampling, cfg.run.seed, policy, tokenizer, reward, data, step.index,
                    step.progress,
                )  # fmt: skip
            record: dict[str, Any] = {"generation": step.index, **stats}
            record.update(train_step(cfg, policy, optimizer, batch, step.index))
            record["seconds"] = round(time.perf_counter() - start, 4)
            if h.due(step.index, cfg.evaluation.every):
                record["heldout_accuracy"] = heldout_accuracy(
                    policy, tokenizer, data, h, *ev, step=step.index
                )
            state.update(step=step.index + 1, elapsed=h.elapsed)
            step.finish(record, lambda: checkpoint.save(run_dir, trained, state))
        state["model_bytes"] = base_bytes
        return _finish(cfg, h, policy, tokenizer, data, state, sft_dir)


def _opening(
    d: DPOConfig, dim: int, pairs: list[PreferencePair] | None, metric: str, baseline: float
) -> str:
    """The run's opening line: the loss, what it trains, where its pairs come from."""
    source = f"{len(pairs)} pairs from {d.pairs}" if pairs else "online pairs"
    return (
        f"DPO ({d.loss}, beta {d.beta}, trainable={d.trainable}): {dim} parameters, "
        f"{source}, {d.pairs_per_step} per step, held-out {metric} baseline {baseline:.3f}"
    )


def _reward(cfg: Config) -> Reward:
    """The reward that ranks online pairs; group rewards work as is (one call per prompt)."""
    from essa.rewards.loading import load_reward

    return load_reward(
        cfg.reward, recipe="DPO", groups=True, provides=frozenset({DRAW_KEYS}), deadline=False
    )


def _pair_prompts(
    pairs: list[PreferencePair] | None, data: DataConfig, tokenizer: Any
) -> list[str] | None:
    """The pairs file's prompts in the run's template; None for online pairs."""
    from essa.data.task import render_prompts

    if pairs is None:
        return None
    questions = [Example(prompt=p.prompt) for p in pairs]
    return render_prompts(questions, data.template, tokenizer, data.system_prompt)


def _load_pairs(path: str) -> list[PreferencePair]:
    from essa.data import DataError
    from essa.data.loaders import load_preference_pairs

    try:
        return load_preference_pairs(path)
    except DataError as err:
        raise UserError(f"dpo.pairs: {err}") from None


def train_step(
    cfg: Config, policy: Policy, optimizer: Optimizer, batch: Rollout | None, step: int
) -> dict[str, Any]:
    """One AdamW step on the DPO loss of ``batch`` (rows: n chosen, then their n rejected)."""
    d = cfg.dpo
    if batch is None:  # no pair this step (online: every group had equal rewards)
        return {"skipped": True}
    for param_group in optimizer.param_groups:
        param_group["lr"] = d.lr * lr_factor(step, cfg.run.generations, 0, d.lr_schedule)
    n = batch.input_ids.shape[0] // 2
    with torch.no_grad(), policy.frozen_reference():
        ref = sequence_logprobs(policy.model, batch)  # (2n,)
    optimizer.zero_grad(set_to_none=True)
    logp = sequence_logprobs(policy.model, batch)  # (2n,)
    tokens = batch.mask.sum(-1)  # (2n,)
    out = dpo_loss(logp[:n], logp[n:], ref[:n], ref[n:], d, tokens[:n], tokens[n:])
    out.loss.backward()
    norm = clip_gradients(policy.params, d.max_grad_norm)
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

    d = cfg.dpo
    final = heldout_accuracy(
        policy, tokenizer, data, h, cfg.generation, cfg.evaluation.micro_batch_size,
        "final held-out", state["step"], final=True,
    )  # fmt: skip
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
