"""Model loading, generation and population evaluation (HF; vLLM in essa.backends.vllm)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from essa.backends.settings import EvaluatorSettings

if TYPE_CHECKING:
    from essa.adapters.svd import SVDAdapter
    from essa.protocols import Evaluator


__all__ = ["EvaluatorSettings", "population_evaluator"]


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

    return PopulationEvaluator(
        base, tokenizer, adapter, settings.generation, settings.evaluation, settings.tools
    )
