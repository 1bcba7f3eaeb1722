"""The gradient recipes: sections ``sft``, ``grpo`` (with CURE, RLEP replay, entropy control and
PRIME), ``dpo`` and ``scalebio``, and the LISA layer sampling they share, with their checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from essa.config.errors import ConfigError
from essa.grpo_variants import VARIANTS


@dataclass(frozen=True)
class LisaConfig:
    """Gradient LISA (Pan et al., arXiv 2403.17919): gamma sampled blocks train per interval."""

    active_layers: int = 2  # gamma (LMFlow's default)
    interval: int = 20  # K optimizer steps between re-samplings (LMFlow's default)
    train_embeddings: bool = True  # the input embedding stays trainable ("E+H always on")
    train_head: bool = True  # the LM head stays trainable (tied to the embedding: counted once)


@dataclass(frozen=True)
class SFTConfig:
    steps: int = 125  # optimizer steps: 2 epochs of data.sft_size at batch_size
    batch_size: int = 16  # the paper's SFT batch (Table 6)
    lr: float = 3e-4
    weight_decay: float = 0.0
    max_length: int = 256  # tokens of prompt + solution
    lr_warmup_steps: int = 0
    trainable: Literal["lora", "full", "lisa"] = "lora"  # full/lisa train the base weights
    lisa: LisaConfig = field(default_factory=LisaConfig)  # trainable: lisa only


@dataclass(frozen=True)
class CureConfig:
    """CURE stage 1 (Li et al., arXiv 2508.11016): branch each rollout at a critical token.

    docs/cure.md: the rule, the reference's settings and where we deviate.
    """

    use_branching: bool = False  # stage 1 on: re-generate from high-entropy critical tokens
    top_k_tokens: int = 20  # the critical token is drawn among a rollout's K most uncertain
    branches: int = 3  # n2 re-generations per original; group_size = n1 * (1 + branches)
    stage1_steps: int | None = None  # steps that branch, then plain sampling (None: all)


@dataclass(frozen=True)
class ReplayConfig:
    """RLEP experience replay (arXiv 2507.07451): verified successes replayed into their groups."""

    capacity: int = 0  # completions the buffer holds (FIFO); 0: off (no collection, no replay)
    ratio: float = 0.0  # replayed completions per fresh one in a group: k = round(ratio * G)
    min_reward: float = 1.0  # a completion is a verified success when its reward >= this
    seed_file: str | None = None  # JSONL of {"prompt", "completion"} (e.g. a run's replay.jsonl)


@dataclass(frozen=True)
class EntropyConfig:
    """Entropy control: 1-shot RLVR's bonus and an ERA-style entropy floor (our reading)."""

    coef: float = 0.0  # loss -= coef * mean token entropy over completion tokens (0: off)
    floor: float = 0.0  # ERA-style activation: per-token entropy kept >= floor nats (0: off)


@dataclass(frozen=True)
class PrimeConfig:
    """PRIME implicit process rewards (arXiv 2502.01456; docs/process-rewards.md §3)."""

    enabled: bool = False  # off: the variant's own group advantages, unchanged
    beta: float = 0.05  # r_t = beta * log(pi_phi / pi_ref) per token (the paper's beta)
    prm_lr: float | None = None  # AdamW of the implicit PRM's LoRA (None: grpo.lr)
    process_weight: float = 1.0  # weight of the process returns (verl reward_dpo_coef, 5)
    outcome_weight: float = 1.0  # weight of the RLOO outcome advantage (reward_gt_coef, 5)
    use_whitening: bool = True  # whiten the token advantages over the step batch (verl)


@dataclass(frozen=True)
class GRPOConfig:
    """The gradient backend (algorithm: grpo); presets per loss in essa/grpo_variants.py."""

    loss: str = "grpo"  # a variant preset (VARIANTS): advantages, normaliser, clip, beta, filter
    group_size: int = 8  # G completions sampled per prompt
    prompts_per_step: int = 8  # prompts per rollout step (G x this completions)
    temperature: float = 1.0  # rollout sampling; held-out accuracy stays greedy (generation.*)
    # AceReason staged temperature: [[step, temperature], ...]; from each step on, rollouts
    # sample at that temperature (before the first listed step: grpo.temperature).
    temperature_schedule: tuple[tuple[float, ...], ...] = ()
    num_iterations: int = 1  # optimizer steps per rollout (mu); > 1 uses old log-probs
    beta: float | None = None  # k3 KL to the frozen SFT adapter (None: the preset's)
    epsilon_low: float | None = None  # ratio clip 1 - epsilon_low (None: the preset's)
    epsilon_high: float | None = None  # ratio clip 1 + epsilon_high (None: the preset's)
    lr: float = 1e-3  # AdamW; the demo's LoRA learns at 1e-3 (TRL's 1e-6 is for full models)
    weight_decay: float = 0.0
    lr_schedule: Literal["constant", "cosine", "linear"] = "cosine"  # over run.generations
    lr_warmup_steps: int = 0
    max_grad_norm: float = 1.0  # 0: no clipping
    grad_accumulation: int = 1  # micro-batches per step, at least (memory only: same update)
    trainable: Literal["lora", "singular_values", "lisa"] = "lora"  # singular_values: SVD-GRPO
    lisa: LisaConfig = field(default_factory=LisaConfig)  # trainable: lisa (SFT LoRA merged first)
    overlong_buffer: int = 0  # DAPO soft overlong punishment L_cache in tokens (0: off)
    cure: CureConfig = field(default_factory=CureConfig)  # critical-token branching (off)
    train_examples: int | None = None  # only the first N training prompts (1-shot RLVR: 1)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    entropy: EntropyConfig = field(default_factory=EntropyConfig)
    prime: PrimeConfig = field(default_factory=PrimeConfig)  # implicit PRM (trainable: lora)
    # reward.name: prm only. sequence: the PRM's aggregate enters the group advantage like any
    # reward; step: each token also gets its step's value minus the whole completion's (PURE's
    # min-form credit with aggregate: min; docs/process-rewards.md §2).
    prm_credit: Literal["sequence", "step"] = "sequence"


@dataclass(frozen=True)
class DPOConfig:
    """algorithm: dpo (Rafailov et al.; docs/dpo-scalebio.md): pairs from a file or online."""

    pairs: str | None = None  # JSONL of {"prompt","chosen","rejected"}; None: online pairs
    loss: Literal["sigmoid", "ipo"] = "sigmoid"  # DPO's logistic loss, or IPO's squared one
    beta: float = 0.1  # KL strength to the frozen SFT reference (IPO: its tau)
    label_smoothing: float = 0.0  # sigmoid only: cDPO's assumed label-flip rate in [0, 0.5)
    pairs_per_step: int = 8  # file: pairs per step; online: prompts drawn per step
    samples_per_prompt: int = 4  # online: k sampled completions per prompt to pair from
    temperature: float = 1.0  # online sampling; held-out accuracy stays greedy
    entropy_floor: float = 0.0  # online sampling: ERA-style per-token entropy floor (0: off)
    train_examples: int | None = None  # only the first N training prompts (as grpo's)
    lr: float = 1e-3  # AdamW (the demo's LoRA scale, as grpo.lr)
    weight_decay: float = 0.0
    lr_schedule: Literal["constant", "cosine"] = "constant"  # cosine: over run.generations
    max_grad_norm: float = 1.0  # 0: no clipping
    trainable: Literal["lora", "lisa"] = "lora"  # lisa: SFT LoRA merged, base weights by LISA
    lisa: LisaConfig = field(default_factory=LisaConfig)  # trainable: lisa only


@dataclass(frozen=True)
class ScaleBiOConfig:
    """algorithm: scalebio (Pan et al., arXiv 2406.19976): source weights by first-order bilevel."""

    batch_size: int = 8  # examples per source, and validation examples, per step
    lr: float = 1e-3  # AdamW of both lower-level models (theta and u), LISA's layers
    weight_decay: float = 0.0
    weight_lr: float = 1.0  # SGD step on the source-weight logits
    penalty: float = 1.0  # lambda: the value-function penalty, constant (the paper grows it)
    max_grad_norm: float = 1.0  # 0: no clipping
    max_length: int = 256  # tokens of prompt + solution
    lisa: LisaConfig = field(default_factory=LisaConfig)


def _check_lisa(prefix: str, lisa: LisaConfig) -> None:
    """Counts >= 1 here; active_layers <= the model's layers is checked at run time."""
    for key, value in (("active_layers", lisa.active_layers), ("interval", lisa.interval)):
        if value < 1:
            raise ConfigError(f"{prefix}.lisa.{key}: must be >= 1, got {value}")


def check_sft(s: SFTConfig) -> None:
    positive = {"sft.batch_size": s.batch_size, "sft.lr": s.lr, "sft.max_length": s.max_length}
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}: must be > 0, got {value}")
    nonneg = {
        "sft.steps": s.steps,
        "sft.weight_decay": s.weight_decay,
        "sft.lr_warmup_steps": s.lr_warmup_steps,
    }
    for key, value in nonneg.items():
        if value < 0:
            raise ConfigError(f"{key}: must be >= 0, got {value}")
    _check_lisa("sft", s.lisa)


def check_grpo(g: GRPOConfig, max_new_tokens: int | str) -> None:
    if g.loss not in VARIANTS:  # the presets' table is the one list of variants
        known = " | ".join(repr(name) for name in VARIANTS)
        raise ConfigError(f"grpo.loss: expected one of {known}, got {g.loss!r}")
    if g.group_size < 2:
        raise ConfigError(f"grpo.group_size: must be >= 2 (a group baseline), got {g.group_size}")
    positive = {
        "grpo.prompts_per_step": g.prompts_per_step,
        "grpo.temperature": g.temperature,
        "grpo.num_iterations": g.num_iterations,
        "grpo.lr": g.lr,
        "grpo.grad_accumulation": g.grad_accumulation,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}: must be > 0, got {value}")
    nonneg = {
        "grpo.beta": g.beta or 0.0,
        "grpo.weight_decay": g.weight_decay,
        "grpo.lr_warmup_steps": g.lr_warmup_steps,
        "grpo.max_grad_norm": g.max_grad_norm,
        "grpo.overlong_buffer": g.overlong_buffer,
        "grpo.epsilon_high": g.epsilon_high or 0.0,
    }
    for key, value in nonneg.items():
        if value < 0:
            raise ConfigError(f"{key}: must be >= 0, got {value}")
    if g.epsilon_low is not None and not 0.0 <= g.epsilon_low < 1.0:
        raise ConfigError(f"grpo.epsilon_low: must be in [0, 1), got {g.epsilon_low}")
    _check_grpo_extensions(g)
    _check_prime(g)
    if isinstance(max_new_tokens, int) and g.overlong_buffer > max_new_tokens:
        raise ConfigError(
            f"grpo.overlong_buffer: {g.overlong_buffer} exceeds generation.max_new_tokens "
            f"({max_new_tokens})"
        )
    _check_cure(g)
    _check_lisa("grpo", g.lisa)


def _check_cure(g: GRPOConfig) -> None:
    c = g.cure
    counts = {"grpo.cure.top_k_tokens": c.top_k_tokens, "grpo.cure.branches": c.branches}
    if c.stage1_steps is not None:
        counts["grpo.cure.stage1_steps"] = c.stage1_steps
    for key, value in counts.items():
        if value < 1:
            raise ConfigError(f"{key}: must be >= 1, got {value}")
    if c.use_branching and g.group_size % (1 + c.branches):
        raise ConfigError(
            f"grpo.group_size: with grpo.cure.branches={c.branches} a group is n1 originals x "
            f"(1 + {c.branches}), so it must be a multiple of {1 + c.branches}, got {g.group_size}"
        )


def _check_grpo_extensions(g: GRPOConfig) -> None:
    """Replay, entropy control, the temperature schedule and the training subset."""
    r, e = g.replay, g.entropy
    nonneg = {
        "grpo.replay.capacity": r.capacity,
        "grpo.replay.ratio": r.ratio,
        "grpo.entropy.coef": e.coef,
        "grpo.entropy.floor": e.floor,
    }
    for key, value in nonneg.items():
        if value < 0:
            raise ConfigError(f"{key}: must be >= 0, got {value}")
    if r.ratio > 0 and round(r.ratio * g.group_size) < 1:
        raise ConfigError(
            f"grpo.replay.ratio: {r.ratio} x grpo.group_size {g.group_size} replays no "
            "completion per group (round(ratio * G) = 0); raise it or set 0 (off)"
        )
    for key, used in (("ratio", r.ratio > 0), ("seed_file", r.seed_file is not None)):
        if used and r.capacity == 0:
            raise ConfigError(
                f"grpo.replay.{key}: needs a buffer, grpo.replay.capacity > 0 (0 is off)"
            )
    if g.train_examples is not None and g.train_examples < 1:
        raise ConfigError(f"grpo.train_examples: must be >= 1, got {g.train_examples}")
    last = -1.0
    for i, stage in enumerate(g.temperature_schedule):
        key = f"grpo.temperature_schedule: stage {i}"
        if len(stage) != 2 or stage[0] != int(stage[0]) or stage[0] < 0 or stage[1] <= 0:
            raise ConfigError(
                f"{key}: expected [step, temperature] with step an integer >= 0 and "
                f"temperature > 0, got {list(stage)}"
            )
        if stage[0] <= last:
            raise ConfigError(f"{key}: steps must increase, got {int(stage[0])} after {int(last)}")
        last = stage[0]


def check_dpo(d: DPOConfig) -> None:
    positive = {
        "dpo.beta": d.beta,
        "dpo.pairs_per_step": d.pairs_per_step,
        "dpo.temperature": d.temperature,
        "dpo.lr": d.lr,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}: must be > 0, got {value}")
    if d.samples_per_prompt < 2:
        raise ConfigError(
            f"dpo.samples_per_prompt: must be >= 2 (a pair), got {d.samples_per_prompt}"
        )
    for key, value in (
        ("dpo.weight_decay", d.weight_decay),
        ("dpo.max_grad_norm", d.max_grad_norm),
    ):
        if value < 0:
            raise ConfigError(f"{key}: must be >= 0, got {value}")
    if not 0.0 <= d.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing: must be in [0, 0.5), got {d.label_smoothing}")
    if d.label_smoothing and d.loss != "sigmoid":
        raise ConfigError("dpo.label_smoothing: applies to loss sigmoid only (cDPO)")
    if d.entropy_floor < 0:
        raise ConfigError(f"dpo.entropy_floor: must be >= 0, got {d.entropy_floor}")
    if d.train_examples is not None and d.train_examples < 1:
        raise ConfigError(f"dpo.train_examples: must be >= 1, got {d.train_examples}")
    _check_lisa("dpo", d.lisa)


def check_scalebio(s: ScaleBiOConfig) -> None:
    positive = {
        "scalebio.batch_size": s.batch_size,
        "scalebio.lr": s.lr,
        "scalebio.weight_lr": s.weight_lr,
        "scalebio.penalty": s.penalty,
        "scalebio.max_length": s.max_length,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}: must be > 0, got {value}")
    for key, value in (
        ("scalebio.weight_decay", s.weight_decay),
        ("scalebio.max_grad_norm", s.max_grad_norm),
    ):
        if value < 0:
            raise ConfigError(f"{key}: must be >= 0, got {value}")
    _check_lisa("scalebio", s.lisa)


def check_prm_credit(g: GRPOConfig, algorithm: str, reward_name: str) -> None:
    if g.prm_credit == "sequence":
        return
    if algorithm != "grpo":
        raise ConfigError(f"grpo.prm_credit: step credit is for algorithm: grpo, not {algorithm}")
    if reward_name != "prm":
        raise ConfigError(
            f"grpo.prm_credit: step credit needs the PRM's step scores: reward.name: prm "
            f"(got {reward_name})"
        )
    clash = {
        "grpo.replay.capacity": g.replay.capacity > 0,  # replayed rows carry no step scores
        "grpo.cure.use_branching": g.cure.use_branching,
        "grpo.prime.enabled": g.prime.enabled,  # PRIME's token advantages replace the group's
    }
    for key, on in clash.items():
        if on:
            raise ConfigError(
                f"grpo.prm_credit: step credit does not combine with {key}; turn one off"
            )


def _check_prime(g: GRPOConfig) -> None:
    p = g.prime
    positive = {"grpo.prime.beta": p.beta, "grpo.prime.prm_lr": p.prm_lr}
    for key, value in positive.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{key}: must be > 0, got {value}")
    for key, value in (
        ("grpo.prime.process_weight", p.process_weight),
        ("grpo.prime.outcome_weight", p.outcome_weight),
    ):
        if value < 0:
            raise ConfigError(f"{key}: must be >= 0, got {value}")
    if not p.enabled:
        return
    if g.trainable != "lora":
        raise ConfigError(
            f"grpo.prime.enabled: the implicit PRM is a LoRA copy; needs grpo.trainable: lora "
            f"(got {g.trainable})"
        )
    if g.replay.capacity:
        raise ConfigError(
            "grpo.prime.enabled: PRIME's outcome labels are the fresh rollouts' own; it does not "
            "combine with grpo.replay (set grpo.replay.capacity: 0)"
        )
    if p.process_weight + p.outcome_weight == 0:
        raise ConfigError("grpo.prime.process_weight: process_weight and outcome_weight are both 0")
