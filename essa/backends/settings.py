"""What a population evaluator reads of the config, gathered from its sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from essa.config import (
    EvaluationConfig,
    GenerationConfig,
    ModelConfig,
    PythonToolConfig,
    VLLMConfig,
)


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
    tools: PythonToolConfig | None = None  # tool-integrated rollouts (HF only); None: text
