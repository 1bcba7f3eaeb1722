"""Model loading, generation and population evaluation (HF; vLLM in essa.backends.vllm)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from essa.config import EvaluationConfig, GenerationConfig, ModelConfig, VLLMConfig

if TYPE_CHECKING:
    from essa.adapters.svd import SVDAdapter
    from essa.protocols import Evaluator


@dataclass(frozen=True)
class EvaluatorSettings:
    """The config a population evaluator reads (``essa.setup.evaluator_settings`` takes it
    from a whole config)."""

    generation: GenerationConfig  # decoding (max_new_tokens resolved)
    evaluation: EvaluationConfig  # HF: strategy, micro-batch, prefix cache
    model: ModelConfig  # vLLM: the checkpoint, its dtype, remote code
    vllm: VLLMConfig  # vLLM: the engine's options
    seed: int  # run.seed: vLLM's engine seed
    population_size: int  # optimizer.population_size: vLLM's LoRA slots per rank
    backend: Literal["hf", "vllm"] = "hf"


def population_evaluator(
    settings: EvaluatorSettings, base: Any, tokenizer: Any, adapter: SVDAdapter, world_size: int
) -> Evaluator:
    """The configured backend's evaluator: HF over ``base`` (the bare base model), or vLLM.

    vLLM loads its own copy of the base: ``base`` is None there, and the caller has dropped its
    references to the HF copy, so that the memory is free before vLLM sizes its own.
    """
    if settings.backend == "vllm":
        from essa.backends.vllm import open_evaluator

        return open_evaluator(settings, tokenizer, adapter, world_size)
    from essa.backends.evaluator import PopulationEvaluator

    return PopulationEvaluator(base, tokenizer, adapter, settings.generation, settings.evaluation)
