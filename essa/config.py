"""One YAML schema of small frozen dataclasses.

Every field has its default here and only here (no ``cfg.get(key, default)`` anywhere else).
Loading is strict: an unknown key or a value of the wrong type raises :class:`ConfigError`
whose message names the file, the line and the dotted key path, e.g.
``configs/demo.yaml:7: optimizer.sigma: unknown key (known: name, population_size, ...)``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

_YAML11_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class ConfigError(ValueError):
    """A user error in a config file or override; the message is one line."""


@dataclass(frozen=True)
class ModelConfig:
    name_or_path: str = "builtin:demo"  # local directory, hub id, or builtin:demo (bundled)
    gguf_file: str | None = None  # a .gguf file inside name_or_path (or an absolute path)
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    trust_remote_code: bool = False  # never on unless the config says so
    quantization: Literal["none", "int8", "int4"] = "none"  # bitsandbytes base weights ([quant])
    quant_type: Literal["nf4", "fp4"] = "nf4"  # int4 only: the 4-bit data type
    use_double_quant: bool = True  # int4 only: quantise the block scales too (~0.4 bit/weight)
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # int4 matmuls
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    num_threads: int | None = None  # torch intra-op threads on CPU (None: torch's default)


@dataclass(frozen=True)
class AdapterConfig:
    path: str | None = None  # a PEFT LoRA directory; None runs the SFT stage first
    rank: int = 8  # LoRA rank r for the SFT stage
    lora_alpha: float = 16.0  # PEFT lora_alpha; scaling gamma = lora_alpha / r
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    alpha: float = 1.0  # ESSA's alpha: fraction of each factor's singular values searched


@dataclass(frozen=True)
class LisaConfig:
    """Gradient LISA (Pan et al., arXiv 2403.17919): gamma sampled blocks train per interval."""

    active_layers: int = 2  # gamma (LMFlow's default)
    interval: int = 20  # K optimizer steps between re-samplings (LMFlow's default)
    train_embeddings: bool = True  # the input embedding stays trainable ("E+H always on")
    train_head: bool = True  # the LM head stays trainable (tied to the embedding: counted once)


@dataclass(frozen=True)
class LayerwiseConfig:
    """Layerwise ES: search only the singular values of sampled layers, block by block."""

    active_layers: int | None = None  # layers searched per block; None searches all (plain ESSA)
    interval: int = 20  # generations per block
    use_carried_sigma: bool = False  # a new block starts at sigma0 (False) or the last sigma


@dataclass(frozen=True)
class SFTConfig:
    steps: int = 125  # optimizer steps: 2 epochs of data.sft_size at batch_size (demo: 4)
    batch_size: int = 16  # the paper's SFT batch (Table 6) (demo: 100, one step per epoch)
    lr: float = 3e-4
    weight_decay: float = 0.0
    max_length: int = 256  # tokens of prompt + solution
    lr_warmup_steps: int = 0
    trainable: Literal["lora", "full", "lisa"] = "lora"  # full/lisa train the base weights
    lisa: LisaConfig = field(default_factory=LisaConfig)  # trainable: lisa only


@dataclass(frozen=True)
class OptimizerConfig:
    name: Literal["cma_es", "openai_es"] = "cma_es"
    population_size: int = 16  # lambda; the paper's default is 96
    # Initial step, in units of each SFT singular value when use_relative_steps: 0.1 (spec §4)
    # keeps a real model's answers intact (demo: 1.0, its tiny latent skill needs big steps).
    sigma0: float = 0.1
    use_relative_steps: bool = True  # scale each coordinate by its SFT singular value
    variant: Literal["auto", "full", "sep"] = "auto"  # cma_es covariance
    sep_above_dim: int = 2000  # cma_es: diagonal covariance above this dimension when auto
    mirrored: bool = False  # cma_es: antithetic candidate pairs (openai_es always samples them)
    # cma_es: when the task reward ties the top 70% of the population (the reference tie-breaker
    # alone ranks them), multiply sigma by exp(0.2 + cs/damps), about 1.22: Hansen's escape from
    # flat fitness, so candidates that all answer alike are pushed apart until the reward ranks.
    escape_flat_reward: bool = False
    # Where the search starts: the SFT adapter (offsets 0), or the no-search baseline's best
    # uniformly scaled SFT adapter (runs the scale baseline; its factor chosen on training
    # prompts), so the search spends no generations on the one direction scaling already finds.
    start: Literal["sft", "scale_baseline"] = "sft"
    lr: float = 0.1  # openai_es step size
    step: Literal["adam", "sgd"] = "adam"  # openai_es step rule
    layerwise: LayerwiseConfig = field(default_factory=LayerwiseConfig)


@dataclass(frozen=True)
class SelectionConfig:
    """GRESO (arXiv 2506.02177): skip prompts whose recent visits had zero reward spread."""

    name: Literal["none", "greso"] = "none"  # none: every drawn prompt is generated
    explore_init: float = 0.5  # base exploration rate p (easy and hard) at the start
    explore_min: float = 0.05  # p stays in [explore_min, explore_max]
    explore_max: float = 0.95
    explore_step: float = 0.01  # p moves this much per step toward the target ratio
    explore_floor: float = 0.01  # a streak's prompt is always kept with at least this chance
    target_zero_spread: float = 0.25  # zero-spread share aimed at (1/3 easy, 2/3 hard)


@dataclass(frozen=True)
class HintConfig:
    """Scaf-GRPO tiered hints: reference-solution prefixes on prompts that stay at zero reward."""

    after: int | None = None  # consecutive zero-reward visits before the first hint; None: off
    tiers: int = 3  # tier t of T shows floor(n*t/(T+1)) of the solution's n lines/words/chars
    format: str = "{question}\nHint: {hint}"  # the hinted question, before the template


@dataclass(frozen=True)
class DataConfig:
    source: str = (
        "builtin:arithmetic"  # builtin:NAME, a local .jsonl/.json/.csv/.parquet, or a hub id
    )
    question_field: str = "question"
    answer_field: str = "answer"
    solution_field: str | None = None  # full reference solution for SFT (default: the answer)
    split: str | None = None  # hub datasets only
    # Prompt template (auto, raw, chat, qwen_math_cot, qwen_boxed, essa_math, r1); auto: the
    # tokenizer's chat template when it has one, else raw (the demo's tokenizer has none).
    template: str = "auto"
    system_prompt: str | None = None  # template chat only: a system turn before the question
    params: dict[str, Any] = field(default_factory=dict)  # reasoning_gym:TASK: the task's config
    sft_size: int = 1000  # training examples reserved for the SFT stage (demo: 100)
    test_size: int = 1000  # held-out examples (builtin tasks have a fixed split)
    # Training pool: only the first N examples after the SFT cut (None: all). A small pool is
    # revisited, which the per-prompt histories of data.selection and data.hints need.
    train_size: int | None = None
    batch_size: int = 64  # prompts per generation, shared by all candidates
    selection: SelectionConfig = field(default_factory=SelectionConfig)  # training prompts only
    hints: HintConfig = field(default_factory=HintConfig)  # training prompts only, never held-out
    # algorithm: scalebio only: the training mixture, name -> local file or builtin:NAME (its
    # training pool); data.source then gives the validation (sft split) and held-out examples.
    sources: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardConfig:
    name: str = "math_accuracy"  # a registered reward or module:function
    params: dict[str, Any] = field(default_factory=dict)
    # Wall-clock bound per call of a custom (module:function) reward; a call that misses it
    # scores None for its items (NaN fitness). Built-in rewards bound themselves. null: no bound.
    timeout_seconds: float | None = 60.0
    # ESSA, HF backend: a dense tie-breaker added to the fitness, w * (mean over prompts of the
    # reference answer's mean token log-prob under the candidate), teacher-forced in the
    # generation's own prefill. 0: off. Correctness moves in steps of 1/batch; this does not.
    reference_weight: float = 0.0


@dataclass(frozen=True)
class GenerationConfig:
    # auto: the longest reference answer in tokens, its stop token and a slack (essa.es.plan);
    # demo: 8 ("a+b=" answers)
    max_new_tokens: int | Literal["auto"] = "auto"
    temperature: float = 0.0  # 0 = greedy (the project default: all variation from parameters)
    top_p: float = 1.0  # nucleus sampling, in (0, 1]; 1 keeps the whole distribution
    # ESSA: completions per (candidate, prompt), sampled under common random numbers; group
    # rewards (TTRL majority vote, EMPO) vote among a candidate's k samples of a prompt.
    samples_per_prompt: int = 1

    @property
    def new_tokens(self) -> int:
        """``max_new_tokens`` once resolved (``essa.es.plan.resolve_lengths`` turns auto into the
        task's number before anything generates)."""
        if self.max_new_tokens == "auto":
            raise RuntimeError("generation.max_new_tokens is still auto: resolve it first")
        return self.max_new_tokens


# Rewards that compare a completion with the reference: the only held-out metrics (registered
# names; module:function rewards are taken at their word).
HELDOUT_METRICS = ("math_accuracy", "exact_match", "gym_score")


@dataclass(frozen=True)
class DriftConfig:
    """What else the final solution changed, beside the held-out score (docs/drift.md)."""

    prompts: int = 32  # off-task prompts for KL(base || tuned) and KL(SFT || tuned); 0: no KL
    tokens: int = 16  # the base model's greedy continuation of each, teacher-forced
    # Retention: greedy accuracy on a built-in task the run does not train on (builtin:NAME);
    # auto: builtin:arithmetic_mixed, or builtin:arithmetic when that is the training task.
    retention: str = "auto"
    items: int = 64  # held-out items for retention and for pass@K; 0: neither
    samples: int = 4  # K completions per held-out item for pass@K, maj@K, mean@K; < 2: none
    temperature: float = 1.0  # pass@K's sampling temperature


@dataclass(frozen=True)
class EvaluationConfig:
    strategy: Literal["auto", "batched", "merged"] = "auto"
    micro_batch_size: int = 1024  # sequences per forward
    every: int = 10  # held-out accuracy every N generations (0: only before and after)
    select: Literal["mean", "best"] = "mean"  # which solution is exported
    # Also report the SFT adapter uniformly scaled (no search): 8 extra populations on 256
    # prompts, so off by default (demo: on, where it is cheap and tells most of the story).
    use_scale_baseline: bool = False
    use_prefix_cache: bool = True  # encode the prompts' shared token prefix once per candidate
    # Greedy, with the reference's likelihood in the fitness: read the reference tokens already
    # in the prefill as a draft, so rows skip the decode steps that would write them again
    # (essa.backends.decode); the tokens are greedy's, up to the matmuls' rounding order.
    reference_draft: bool = True
    # Held-out score: a correctness metric (HELDOUT_METRICS) or module:function comparing with
    # the reference answers. None: the training reward when it is one of these, else
    # math_accuracy (a shaping or label-free training reward says nothing about correctness).
    metric: str | None = None
    drift: DriftConfig = field(default_factory=DriftConfig)  # the final pass only


@dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/essa-demo"
    generations: int = 150
    seed: int = 0  # 0 .. 2**32 - 1 (numpy's and vLLM's seeds are 32-bit)
    max_wall_seconds: float | None = None  # stop before a generation would end past this budget
    # ESSA (HF backend) with max_wall_seconds: size SFT, held-out checks, the scaled start and
    # prompts per generation so that the search gets most of the budget (essa.es.plan)
    plan: bool = True
    show_progress: bool = True
    # Experiment trackers, any subset (none by default; [track] extra), all offline-safe.
    report_to: tuple[Literal["tensorboard", "wandb", "trackio"], ...] = ()


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


GRPOLoss = Literal["grpo", "dr_grpo", "dapo", "ngrpo", "w_reinforce", "psr", "nsr", "dcpo"]


@dataclass(frozen=True)
class GRPOConfig:
    """The gradient backend (algorithm: grpo); presets per loss in essa/gradient/losses.py."""

    loss: GRPOLoss = "grpo"  # variant preset: advantages, normaliser, clip range, beta, filter
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
    grad_accumulation: int = 1  # micro-batches per optimizer step (memory only: same update)
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


@dataclass(frozen=True)
class VLLMConfig:
    """Engine options of ``backend: vllm`` (docs/vllm.md); ignored by the HF backend."""

    tensor_parallel_size: int = 1  # GPUs per engine (one engine per MPI rank)
    gpu_memory_utilization: float = 0.85  # fraction of GPU memory vLLM may take
    max_loras: int | None = None  # candidate adapters per batch (None: the rank's population)
    max_lora_rank: int | None = None  # None: the adapter's rank rounded up to vLLM's sizes
    max_model_len: int | None = None  # None: the model's own limit
    quantization: str | None = None  # vLLM's name: awq, gptq, fp8, compressed-tensors, ...
    kv_cache_space_gb: int | None = 1  # CPU only: VLLM_CPU_KVCACHE_SPACE (whole GiB)
    enforce_eager: bool = False  # no CUDA graphs / torch.compile (faster start, slower decode)
    enable_prefix_caching: bool = True  # reuse KV blocks of shared prompt prefixes
    max_num_seqs: int | None = None  # sequences per engine step (None: vLLM's default)


@dataclass(frozen=True)
class PythonToolConfig:
    """The sandboxed Python executor (essa.tools.sandbox, docs/tools.md): limits per snippet."""

    timeout_seconds: float = 5.0  # wall clock; the CPU-time limit is this, rounded up
    memory_mb: int = 512  # address space of each process in the sandbox (RLIMIT_AS)
    max_processes: int = 16  # processes and threads the snippet may have at once (RLIMIT_NPROC)
    max_file_mb: int = 16  # size of the private /tmp, and of any one file (RLIMIT_FSIZE)
    max_output_chars: int = 4096  # per stream; past it the output is cut and the snippet stopped
    max_concurrent: int = 4  # snippets of a batch run at once (one process tree each)
    # Without bubblewrap, run snippets as plain subprocesses with the same resource limits but
    # no isolation (they can read the filesystem and reach the network); off: a missing bwrap
    # is an error.
    allow_unisolated: bool = False


@dataclass(frozen=True)
class ToolsConfig:
    python: PythonToolConfig = field(default_factory=PythonToolConfig)


@dataclass(frozen=True)
class Config:
    algorithm: Literal["essa", "grpo", "dpo", "scalebio"] = "essa"
    backend: Literal["hf", "vllm"] = "hf"  # evaluation backend of the ESSA recipe
    model: ModelConfig = field(default_factory=ModelConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    run: RunConfig = field(default_factory=RunConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    scalebio: ScaleBiOConfig = field(default_factory=ScaleBiOConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)


# The bundled demo's values where they differ from the schema's real-model defaults, filled in
# by load_config when model.name_or_path is builtin:demo and the config does not set the key.
# configs/demo.yaml spells them out; these keep `essa train --set ...` on the demo the same.
DEMO_MODEL = "builtin:demo"
DEMO_DEFAULTS: dict[str, Any] = {
    "sft.steps": 4,
    "sft.batch_size": 100,
    "optimizer.sigma0": 1.0,
    "data.template": "raw",
    "data.sft_size": 100,
    "generation.max_new_tokens": 8,
    "evaluation.use_scale_baseline": True,
}


# ---------------------------------------------------------------------------------------------
# Loading


def _line_map(node: yaml.Node, prefix: str, lines: dict[str, int]) -> None:
    """Record the 1-based line of every mapping key, keyed by dotted path."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            lines[path] = key_node.start_mark.line + 1
            _line_map(value_node, path, lines)


def _where(source: str, lines: dict[str, int], path: str) -> str:
    line = lines.get(path)
    return f"{source}:{line}" if line is not None else source


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(v) for v in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "null")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to float)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            try:
                return _coerce(value, arm, path)
            except ConfigError:
                continue
        names = " or ".join(_type_name(a) for a in typing.get_args(tp))
        raise ConfigError(f"{path}: expected {names}, got {value!r}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{path}: expected one of {_type_name(tp)}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (arm, _) = typing.get_args(tp)
        return tuple(_coerce(v, arm, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{path}: expected null, got {value!r}")
        return None
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads "3e-4" (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:  # an integer too large for a float
            number = math.inf
        if not math.isfinite(number):  # .nan would slip through every range check
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported annotation {tp!r} at {path}")  # a bug in this module


def _build(cls: type, data: Any, prefix: str, where: typing.Callable[[str], str]) -> Any:
    """Build dataclass ``cls`` from a mapping, strictly."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where(prefix)}: {prefix or 'config'}: expected a mapping, got {data!r}"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            known = ", ".join(fields)
            raise ConfigError(f"{where(path)}: {path}: unknown key (known: {known})")
        tp = hints[key]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, path, where)
            continue
        try:
            kwargs[key] = _coerce(value, tp, path)
        except ConfigError as err:
            raise ConfigError(f"{where(path)}: {err}") from None
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``a.b=value`` (value is YAML: ``0.2``, ``true``, ``[q_proj, v_proj]``, ``null``)."""
    if "=" not in text:
        raise ConfigError(f"--set {text}: expected KEY=VALUE, e.g. optimizer.sigma0=0.2")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except (yaml.YAMLError, RecursionError):
        value = raw
    return key.strip().split("."), value


def _apply_override(data: dict[str, Any], keys: list[str], value: Any) -> None:
    node = data
    for k in keys[:-1]:
        child = node.get(k)
        if child is None:
            child = node[k] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {'.'.join(keys)}: {k} is not a section")
        node = child
    node[keys[-1]] = value


def _fill_demo_defaults(data: dict[str, Any]) -> None:
    """Give a builtin:demo config the demo's values (:data:`DEMO_DEFAULTS`) for unset keys."""
    model = data.get("model")
    name = model.get("name_or_path", DEMO_MODEL) if isinstance(model, dict) else DEMO_MODEL
    if name != DEMO_MODEL:
        return
    for dotted, value in DEMO_DEFAULTS.items():
        section, key = dotted.split(".")
        node = data.get(section)
        if node is None:
            node = data[section] = {}
        if isinstance(node, dict):  # a non-mapping section fails in _build with its line
            node.setdefault(key, value)


TINY_SFT_STEPS = 20


def tiny_sft_warning(cfg: Config) -> str | None:
    """One line when a real (non-builtin) model starts from a tiny SFT of its own, else None.

    Tiny: fewer than :data:`TINY_SFT_STEPS` optimizer steps, or less than one pass over the
    SFT examples; the search can only rescale what SFT found (essa.md §1.2).
    """
    if cfg.model.name_or_path.startswith("builtin:") or cfg.adapter.path is not None:
        return None
    s = cfg.sft
    if s.steps >= TINY_SFT_STEPS and s.steps * s.batch_size >= cfg.data.sft_size:
        return None
    return (
        f"warning: sft.steps={s.steps} x sft.batch_size={s.batch_size} on "
        f"{cfg.data.sft_size} examples is a tiny SFT for {cfg.model.name_or_path}; ESSA only "
        "searches the singular values SFT found, so train a real SFT first (raise sft.steps, "
        "or set adapter.path to a trained LoRA)"
    )


def demo_config() -> Config:
    """The embedded default (``essa train`` with no arguments): the schema plus the demo's values."""
    return load_config(None)


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Load and validate a config file (or the embedded default when ``path`` is None)."""
    source = str(path) if path is not None else "<default>"
    lines: dict[str, int] = {}
    data: Any = {}
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"{source}: cannot read config: {err.strerror}") from None
        except UnicodeDecodeError as err:
            raise ConfigError(
                f"{source}: not a UTF-8 text file (byte {err.start}: {err.reason})"
            ) from None
        try:
            node = yaml.compose(text)
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or "invalid YAML"
            raise ConfigError(f"{source}{line}: invalid YAML: {problem}") from None
        except RecursionError:  # PyYAML composes nested collections recursively
            raise ConfigError(f"{source}: invalid YAML: nested too deeply") from None
        if node is not None:
            _line_map(node, "", lines)
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of sections")
    overridden: set[str] = set()
    for text in overrides:
        keys, value = parse_override(text)
        _apply_override(data, keys, value)
        overridden.add(".".join(keys))

    _fill_demo_defaults(data)

    def where(key_path: str) -> str:
        if key_path in overridden:
            return f"--set {key_path}"
        return _where(source, lines, key_path)

    cfg = _build(Config, data, "", where)
    try:
        check_values(cfg)
    except ConfigError as err:
        key = str(err).split(":", 1)[0]
        raise ConfigError(f"{where(key)}: {err}") from None
    return cfg


# run.seed feeds numpy's legacy and vLLM's seeds, which take 32 bits; torch takes 64.
MAX_SEED = 2**32 - 1


def key_location(path: str | Path | None, overrides: typing.Sequence[str], key: str) -> str:
    """Where ``key`` of the config :func:`load_config` built from ``path`` and ``overrides`` was
    set, as its errors say it: ``--set KEY``, ``FILE:LINE``, or ``FILE`` (``<default>``)."""
    if any(parse_override(text)[0] == key.split(".") for text in overrides):
        return f"--set {key}"
    if path is None:
        return "<default>"
    lines: dict[str, int] = {}
    try:
        node = yaml.compose(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError):
        node = None  # it loaded a moment ago; without it, the file alone
    if node is not None:
        _line_map(node, "", lines)
    return _where(str(path), lines, key)


def check_values(cfg: Config) -> None:
    """Range checks that types cannot express."""
    positive = {
        "optimizer.sigma0": cfg.optimizer.sigma0,
        "optimizer.lr": cfg.optimizer.lr,
        "adapter.rank": cfg.adapter.rank,
        "adapter.lora_alpha": cfg.adapter.lora_alpha,
        "data.batch_size": cfg.data.batch_size,
        "generation.max_new_tokens": (
            1 if cfg.generation.max_new_tokens == "auto" else cfg.generation.max_new_tokens
        ),
        "evaluation.micro_batch_size": cfg.evaluation.micro_batch_size,
        "sft.batch_size": cfg.sft.batch_size,
        "sft.lr": cfg.sft.lr,
        "sft.max_length": cfg.sft.max_length,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}: must be > 0, got {value}")
    nonneg = {
        "run.generations": cfg.run.generations,
        "sft.steps": cfg.sft.steps,
        "sft.weight_decay": cfg.sft.weight_decay,
        "sft.lr_warmup_steps": cfg.sft.lr_warmup_steps,
        "optimizer.sep_above_dim": cfg.optimizer.sep_above_dim,
        "evaluation.every": cfg.evaluation.every,
        "evaluation.drift.prompts": cfg.evaluation.drift.prompts,
        "evaluation.drift.items": cfg.evaluation.drift.items,
        "evaluation.drift.samples": cfg.evaluation.drift.samples,
        "data.test_size": cfg.data.test_size,
        "data.sft_size": cfg.data.sft_size,
    }
    for key, value in nonneg.items():
        if value < 0:
            raise ConfigError(f"{key}: must be >= 0, got {value}")
    _check_run(cfg)
    if cfg.data.train_size is not None and cfg.data.train_size < 1:
        raise ConfigError(f"data.train_size: must be >= 1 or null, got {cfg.data.train_size}")
    if cfg.reward.timeout_seconds is not None and not cfg.reward.timeout_seconds > 0:
        raise ConfigError(f"reward.timeout_seconds: must be > 0, got {cfg.reward.timeout_seconds}")
    if not 0.0 < cfg.adapter.alpha <= 1.0:
        raise ConfigError(f"adapter.alpha: must be in (0, 1], got {cfg.adapter.alpha}")
    if int(cfg.adapter.alpha * cfg.adapter.rank) == 0 and cfg.adapter.path is None:
        raise ConfigError(
            f"adapter.alpha: {cfg.adapter.alpha} with adapter.rank={cfg.adapter.rank} selects zero "
            "singular values per factor (floor(alpha*r) = 0); raise alpha or rank"
        )
    if cfg.optimizer.mirrored and cfg.optimizer.name != "cma_es":
        raise ConfigError("optimizer.mirrored: applies to cma_es (openai_es is always antithetic)")
    if cfg.optimizer.escape_flat_reward and (
        cfg.optimizer.name != "cma_es" or cfg.optimizer.layerwise.active_layers is not None
    ):
        raise ConfigError(
            "optimizer.escape_flat_reward: applies to cma_es without layerwise (it widens "
            "CMA-ES's step size)"
        )
    if cfg.optimizer.mirrored and cfg.optimizer.population_size % 2:
        raise ConfigError("optimizer.population_size: mirrored pairs need an even population")
    if cfg.optimizer.name == "openai_es" and cfg.optimizer.population_size % 2:
        raise ConfigError(
            "optimizer.population_size: openai_es needs an even population (antithetic pairs)"
        )
    _check_reference_weight(cfg)
    _check_sft_adapter(cfg)
    if cfg.generation.temperature < 0:
        raise ConfigError("generation.temperature: must be >= 0")
    if not 0.0 < cfg.generation.top_p <= 1.0:
        raise ConfigError(f"generation.top_p: must be in (0, 1], got {cfg.generation.top_p}")
    if cfg.generation.samples_per_prompt < 1:
        raise ConfigError("generation.samples_per_prompt: must be >= 1")
    if cfg.generation.samples_per_prompt > 1 and cfg.generation.temperature == 0:
        raise ConfigError(
            "generation.samples_per_prompt: greedy decoding (temperature 0) gives k identical "
            "samples; set generation.temperature > 0 (e.g. 0.7) or samples_per_prompt: 1"
        )
    if cfg.model.quantization != "none" and cfg.model.gguf_file:
        raise ConfigError(
            f"model.quantization: {cfg.model.quantization} cannot be combined with "
            "model.gguf_file (transformers does not quantise GGUF checkpoints); save the model "
            "as safetensors first (see bench/quant.py), or use quantization=none"
        )
    if cfg.model.quantization != "none" and cfg.evaluation.strategy == "merged":
        raise ConfigError(
            f"evaluation.strategy: merged cannot fold candidates into "
            f"model.quantization={cfg.model.quantization} weights; use batched or auto"
        )
    _check_heldout_metric(cfg.evaluation.metric)
    _check_drift(cfg.evaluation.drift)
    _check_data(cfg)
    _check_grpo(cfg.grpo, cfg.generation.max_new_tokens)
    _check_prm_credit(cfg)
    _check_dpo(cfg.dpo)
    _check_scalebio(cfg)
    _check_layer_sampling(cfg)
    _check_vllm(cfg)
    _check_python_tool(cfg.tools.python)


def _check_sft_adapter(cfg: Config) -> None:
    """ESSA searches the SFT adapter's singular values: refuse one that is zero by config."""
    if cfg.algorithm != "essa" or cfg.adapter.path is not None:
        return
    if cfg.sft.steps == 0 and cfg.optimizer.use_relative_steps:
        raise ConfigError(
            "sft.steps: must be > 0 without adapter.path: 0 leaves the new LoRA's B at zero "
            "(PEFT's initialisation) and ESSA's relative steps have no singular value to "
            "scale; train it, or set adapter.path to a trained LoRA"
        )


def _check_run(cfg: Config) -> None:
    """The run's seed, budget and trackers; the model's thread count; the population."""
    r = cfg.run
    if not 0 <= r.seed <= MAX_SEED:
        raise ConfigError(f"run.seed: must be an integer in [0, {MAX_SEED}], got {r.seed}")
    if r.max_wall_seconds is not None and r.max_wall_seconds <= 0:
        raise ConfigError(f"run.max_wall_seconds: must be > 0 (or null), got {r.max_wall_seconds}")
    if len(set(r.report_to)) != len(r.report_to):
        raise ConfigError(f"run.report_to: a tracker is named twice: {list(r.report_to)}")
    if cfg.model.num_threads is not None and cfg.model.num_threads < 1:
        raise ConfigError(f"model.num_threads: must be >= 1 (or null), got {cfg.model.num_threads}")
    if cfg.optimizer.population_size < 2:
        raise ConfigError(
            f"optimizer.population_size: must be >= 2 (ES ranks candidates), got "
            f"{cfg.optimizer.population_size}"
        )


def _check_data(cfg: Config) -> None:
    d = cfg.data
    _check_informative(d.selection, d.hints)
    if d.system_prompt is not None and d.template not in ("chat", "auto"):
        raise ConfigError(
            f"data.system_prompt: applies to template chat only; template {d.template} has "
            "its own fixed prompt"
        )
    if d.params and not d.source.startswith("reasoning_gym:"):
        raise ConfigError(
            f"data.params: only reasoning_gym:TASK sources take parameters, not {d.source}"
        )
    gym_params = cfg.reward.params.get("params") or {}
    if cfg.reward.name == "gym_score" and gym_params != d.params:
        raise ConfigError(
            "reward.params.params: gym_score regenerates the task, so it needs the same "
            f"parameters as data.params; got {gym_params} vs {d.params}"
        )


def _check_drift(d: DriftConfig) -> None:
    from essa.data.loaders import BUILTIN_SOURCES

    if d.tokens < 1:
        raise ConfigError(f"evaluation.drift.tokens: must be >= 1, got {d.tokens}")
    if not d.temperature > 0:
        raise ConfigError(f"evaluation.drift.temperature: must be > 0, got {d.temperature}")
    if d.retention not in ("auto", "none", *BUILTIN_SOURCES):
        raise ConfigError(
            f"evaluation.drift.retention: {d.retention!r} is not auto, none or one of "
            f"{', '.join(BUILTIN_SOURCES)}"
        )


def _check_informative(s: SelectionConfig, h: HintConfig) -> None:
    for key in ("explore_min", "explore_init", "explore_max"):
        if not 0.0 < getattr(s, key) <= 1.0:
            raise ConfigError(f"data.selection.{key}: must be in (0, 1], got {getattr(s, key)}")
    if not s.explore_min <= s.explore_init <= s.explore_max:
        raise ConfigError(
            "data.selection: need 0 < explore_min <= explore_init <= explore_max <= 1, got "
            f"{s.explore_min}, {s.explore_init}, {s.explore_max}"
        )
    for key, value in (
        ("explore_step", s.explore_step),
        ("explore_floor", s.explore_floor),
        ("target_zero_spread", s.target_zero_spread),
    ):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"data.selection.{key}: must be in [0, 1], got {value}")
    if h.after is not None and h.after < 1:
        raise ConfigError(f"data.hints.after: must be >= 1 (or null: no hints), got {h.after}")
    if h.tiers < 1:
        raise ConfigError(f"data.hints.tiers: must be >= 1, got {h.tiers}")
    try:
        shown = h.format.format(question="\0", hint="\1")
    except (KeyError, IndexError, ValueError) as err:
        raise ConfigError(
            f"data.hints.format: {h.format!r} must use only {{question}} and {{hint}} ({err})"
        ) from None
    if "\0" not in shown or "\1" not in shown:
        raise ConfigError(f"data.hints.format: {h.format!r} must contain {{question}} and {{hint}}")


def _check_heldout_metric(metric: str | None) -> None:
    if metric is None or metric in HELDOUT_METRICS or ":" in metric:
        return
    raise ConfigError(
        f"evaluation.metric: {metric!r} does not compare completions with the reference answers, "
        f"so it cannot score held-out data; use one of {', '.join(HELDOUT_METRICS)} or "
        "module:function"
    )


# Recent vLLM releases dropped these (infra §3.5); any other name is checked by vLLM itself.
VLLM_DROPPED_QUANTIZATION = ("bitsandbytes", "bnb", "gguf")


def _check_reference_weight(cfg: Config) -> None:
    w = cfg.reward.reference_weight
    if not math.isfinite(w) or w < 0:
        raise ConfigError(f"reward.reference_weight: must be a finite number >= 0, got {w}")
    if w and cfg.algorithm != "essa":
        raise ConfigError(
            "reward.reference_weight: the tie-breaker is part of the ESSA fitness; "
            f"algorithm {cfg.algorithm} takes the reward as it is (set it to 0)"
        )
    if w and cfg.backend != "hf":
        raise ConfigError(
            "reward.reference_weight: the reference is teacher-forced in the HF decode loop's "
            "prefill; backend: vllm does not return prompt log-probs per candidate (set it to 0)"
        )


def _check_vllm(cfg: Config) -> None:
    v = cfg.vllm
    _check_vllm_ranges(v)
    if cfg.backend != "vllm":
        return
    if cfg.algorithm != "essa":
        raise ConfigError(
            f"backend: vllm evaluates ESSA populations only; algorithm {cfg.algorithm} "
            "needs backend: hf"
        )
    if cfg.model.quantization != "none":
        raise ConfigError(
            f"model.quantization: {cfg.model.quantization} is bitsandbytes (HF backend only); "
            "vLLM dropped bitsandbytes: with backend: vllm use a pre-quantised AWQ/GPTQ/FP8 "
            "checkpoint and vllm.quantization"
        )
    if cfg.model.gguf_file:
        raise ConfigError("model.gguf_file: GGUF checkpoints need backend: hf")
    if v.quantization in VLLM_DROPPED_QUANTIZATION:
        raise ConfigError(
            f"vllm.quantization: {v.quantization} is gone from recent vLLM; INT4 on vLLM means "
            "a pre-quantised AWQ/GPTQ checkpoint (or fp8, compressed-tensors)"
        )


def _check_vllm_ranges(v: VLLMConfig) -> None:
    """Checked whatever the backend: a value out of range is a typo even where unused."""
    if not 0.0 < v.gpu_memory_utilization <= 1.0:
        raise ConfigError(
            f"vllm.gpu_memory_utilization: must be in (0, 1], got {v.gpu_memory_utilization}"
        )
    positive = {
        "vllm.tensor_parallel_size": v.tensor_parallel_size,
        "vllm.max_loras": v.max_loras,
        "vllm.max_lora_rank": v.max_lora_rank,
        "vllm.max_model_len": v.max_model_len,
        "vllm.kv_cache_space_gb": v.kv_cache_space_gb,
        "vllm.max_num_seqs": v.max_num_seqs,
    }
    for key, value in positive.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{key}: must be > 0, got {value}")


def _check_python_tool(p: PythonToolConfig) -> None:
    """Checked whether or not a recipe runs tools: a value out of range is a typo even where unused."""
    positive = {
        "tools.python.timeout_seconds": p.timeout_seconds,
        "tools.python.memory_mb": p.memory_mb,
        "tools.python.max_processes": p.max_processes,
        "tools.python.max_file_mb": p.max_file_mb,
        "tools.python.max_output_chars": p.max_output_chars,
        "tools.python.max_concurrent": p.max_concurrent,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}: must be > 0, got {value}")


def _check_layer_sampling(cfg: Config) -> None:
    """LISA and layerwise ES: counts >= 1 here; active_layers <= the model's layers at run time."""
    checks = {
        "sft.lisa.active_layers": cfg.sft.lisa.active_layers,
        "sft.lisa.interval": cfg.sft.lisa.interval,
        "grpo.lisa.active_layers": cfg.grpo.lisa.active_layers,
        "grpo.lisa.interval": cfg.grpo.lisa.interval,
        "dpo.lisa.active_layers": cfg.dpo.lisa.active_layers,
        "dpo.lisa.interval": cfg.dpo.lisa.interval,
        "scalebio.lisa.active_layers": cfg.scalebio.lisa.active_layers,
        "scalebio.lisa.interval": cfg.scalebio.lisa.interval,
        "optimizer.layerwise.interval": cfg.optimizer.layerwise.interval,
    }
    if cfg.optimizer.layerwise.active_layers is not None:
        checks["optimizer.layerwise.active_layers"] = cfg.optimizer.layerwise.active_layers
    for key, value in checks.items():
        if value < 1:
            raise ConfigError(f"{key}: must be >= 1, got {value}")


def _check_grpo(g: GRPOConfig, max_new_tokens: int | str) -> None:
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


def _check_dpo(d: DPOConfig) -> None:
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


def _check_scalebio(cfg: Config) -> None:
    s = cfg.scalebio
    sources = cfg.data.sources
    if sources and cfg.algorithm != "scalebio":
        raise ConfigError(
            f"data.sources: a mixture of sources is trained by algorithm: scalebio, not "
            f"{cfg.algorithm} (use data.source)"
        )
    for name, path in sources.items():
        if not isinstance(path, str) or not path:
            raise ConfigError(f"data.sources.{name}: expected a file path or builtin:NAME")
    _check_scalebio_ranges(s)
    if cfg.algorithm != "scalebio":
        return
    if len(sources) < 2:
        raise ConfigError(
            f"data.sources: scalebio reweights two or more sources (name: path), got {len(sources)}"
        )
    if cfg.data.sft_size < 1:
        raise ConfigError(
            "data.sft_size: scalebio validates on the sft split of data.source; must be >= 1"
        )
    if cfg.adapter.path is not None:
        raise ConfigError(
            "adapter.path: scalebio fine-tunes the base weights with LISA and takes no LoRA "
            "adapter; merge it into the model first (essa export --merged) or drop adapter.path"
        )


def _check_scalebio_ranges(s: ScaleBiOConfig) -> None:
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


def _check_prm_credit(cfg: Config) -> None:
    g = cfg.grpo
    if g.prm_credit == "sequence":
        return
    if cfg.algorithm != "grpo":
        raise ConfigError(
            f"grpo.prm_credit: step credit is for algorithm: grpo, not {cfg.algorithm}"
        )
    if cfg.reward.name != "prm":
        raise ConfigError(
            f"grpo.prm_credit: step credit needs the PRM's step scores: reward.name: prm "
            f"(got {cfg.reward.name})"
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


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain-data view (tuples as lists) suitable for YAML/JSON."""

    def plain(v: Any) -> Any:
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(cfg))


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
