"""Population evaluator: batched, merged and auto give the same completions for the same candidates."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from essa.config import AdapterConfig, EvaluationConfig, GenerationConfig, ModelConfig


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from essa.adapters import SVDAdapter
    from essa.backends.hf import load_model
    from essa.recipes.sft import make_lora_model

    model, tokenizer = load_model(ModelConfig(name_or_path=str(tiny_model_dir)))
    peft_model = make_lora_model(model, AdapterConfig(rank=4, lora_alpha=8))
    gen = torch.Generator().manual_seed(1)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero; a trained adapter has non-zero B
            param.data = torch.randn(param.shape, generator=gen) * 0.3
    adapter = SVDAdapter.from_peft_model(peft_model, alpha=1.0)
    return peft_model.unload(), tokenizer, adapter


PROMPTS = ["12+3=", "7+45=", "1+1=", "99+99="]


def population(adapter, n: int = 4) -> np.ndarray:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, adapter.dim)) * adapter.stds() * 2.0


@pytest.mark.parametrize("micro_batch_size", [3, 1024])
def test_strategies_agree(setup, micro_batch_size: int) -> None:  # type: ignore[no-untyped-def]
    from essa.backends.evaluator import PopulationEvaluator

    model, tokenizer, adapter = setup
    X = population(adapter)
    gen = GenerationConfig(max_new_tokens=6)
    outs = {}
    for strategy in ("batched", "merged", "auto"):
        cfg = EvaluationConfig(strategy=strategy, micro_batch_size=micro_batch_size)
        evaluator = PopulationEvaluator(model, tokenizer, adapter, gen, cfg)
        outs[strategy] = evaluator.completions(X, PROMPTS)
        assert evaluator.stats.sequences == len(X) * len(PROMPTS)
    assert outs["batched"] == outs["merged"] == outs["auto"]
    assert len({tuple(c) for c in outs["batched"]}) > 1, "candidates should differ"


def test_auto_records_choice_and_reuses_it(setup) -> None:  # type: ignore[no-untyped-def]
    from essa.backends.evaluator import PopulationEvaluator

    model, tokenizer, adapter = setup
    evaluator = PopulationEvaluator(model, tokenizer, adapter, GenerationConfig(max_new_tokens=4),
                                    EvaluationConfig(strategy="auto"))
    evaluator.completions(population(adapter), PROMPTS)
    assert evaluator.chosen[len(PROMPTS)] in ("batched", "merged")
    assert set(evaluator.stats.strategy_seconds) == {"batched", "merged"}
    # The model is left unwrapped and unmerged: the zero vector reproduces the SFT adapter.
    names = {type(m).__name__ for m in model.modules()}
    assert "PopulationLinear" not in names
