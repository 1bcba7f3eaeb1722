"""The model, its adapter, decoding and the vLLM engine: sections ``model``, ``adapter``,
``generation`` and ``vllm`` with their range checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from essa.config.errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    name_or_path: str = "builtin:demo"  # local directory, hub id, or builtin:demo (bundled)
    gguf_file: str | None = None  # a .gguf file inside name_or_path (or an absolute path)
    # auto: the checkpoint's; fast: bfloat16 where the device multiplies it natively (a CUDA GPU
    # with bf16, a CPU with AVX512-BF16 or AMX), float32 elsewhere (essa.backends.models)
    dtype: Literal["float32", "bfloat16", "float16", "auto", "fast"] = "float32"
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
class GenerationConfig:
    # auto: the longest reference answer in tokens, its stop token and a slack (essa.es.plan)
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


# Recent vLLM releases dropped these (infra §3.5); any other name is checked by vLLM itself.
VLLM_DROPPED_QUANTIZATION = ("bitsandbytes", "bnb", "gguf")


def check_model(m: ModelConfig) -> None:
    if m.num_threads is not None and m.num_threads < 1:
        raise ConfigError(f"model.num_threads: must be >= 1 (or null), got {m.num_threads}")
    if m.quantization != "none" and m.gguf_file:
        raise ConfigError(
            f"model.quantization: {m.quantization} cannot be combined with "
            "model.gguf_file (transformers does not quantise GGUF checkpoints); save the model "
            "as safetensors first (see bench/benchmarks/quant.py), or use quantization=none"
        )


def check_adapter(a: AdapterConfig) -> None:
    for key, value in (("adapter.rank", a.rank), ("adapter.lora_alpha", a.lora_alpha)):
        if value <= 0:
            raise ConfigError(f"{key}: must be > 0, got {value}")
    if not 0.0 < a.alpha <= 1.0:
        raise ConfigError(f"adapter.alpha: must be in (0, 1], got {a.alpha}")
    if int(a.alpha * a.rank) == 0 and a.path is None:
        raise ConfigError(
            f"adapter.alpha: {a.alpha} with adapter.rank={a.rank} selects zero "
            "singular values per factor (floor(alpha*r) = 0); raise alpha or rank"
        )


def check_generation(g: GenerationConfig) -> None:
    if g.max_new_tokens != "auto" and g.max_new_tokens <= 0:
        raise ConfigError(f"generation.max_new_tokens: must be > 0, got {g.max_new_tokens}")
    if g.temperature < 0:
        raise ConfigError("generation.temperature: must be >= 0")
    if not 0.0 < g.top_p <= 1.0:
        raise ConfigError(f"generation.top_p: must be in (0, 1], got {g.top_p}")
    if g.samples_per_prompt < 1:
        raise ConfigError("generation.samples_per_prompt: must be >= 1")
    if g.samples_per_prompt > 1 and g.temperature == 0:
        raise ConfigError(
            "generation.samples_per_prompt: greedy decoding (temperature 0) gives k identical "
            "samples; set generation.temperature > 0 (e.g. 0.7) or samples_per_prompt: 1"
        )


def check_vllm_ranges(v: VLLMConfig) -> None:
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
