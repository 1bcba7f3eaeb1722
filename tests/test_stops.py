"""Stop tokens: the union of the tokenizer's EOS and the model's generation_config EOS list."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest

from essa.backends.stops import stop_token_ids
from essa.config import GenerationConfig


def test_union_keeps_tokenizer_eos_first_and_drops_duplicates() -> None:
    tokenizer = SimpleNamespace(eos_token_id=1)
    assert stop_token_ids(tokenizer, SimpleNamespace(eos_token_id=[5, 1, 9])) == [1, 5, 9]
    assert stop_token_ids(tokenizer, SimpleNamespace(eos_token_id=5)) == [1, 5]
    assert stop_token_ids(tokenizer, SimpleNamespace(eos_token_id=None)) == [1]
    assert stop_token_ids(tokenizer, None) == [1]
    assert stop_token_ids(SimpleNamespace(eos_token_id=None), None) == []


def test_vllm_reads_the_model_generation_config(tmp_path: Path) -> None:
    """The vLLM backend's stop list comes from the model directory (vLLM itself not needed)."""
    from transformers import GenerationConfig as HFGenerationConfig

    from essa.backends.vllm import model_generation_config

    assert model_generation_config(str(tmp_path)) is None  # no generation_config.json
    assert model_generation_config("org/not-a-dir") is None
    HFGenerationConfig(eos_token_id=[7, 3]).save_pretrained(tmp_path)
    config = model_generation_config(str(tmp_path))
    assert stop_token_ids(SimpleNamespace(eos_token_id=3), config) == [3, 7]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from essa.backends.models import load_model
    from essa.config import ModelConfig

    return load_model(ModelConfig(name_or_path=str(tiny_model_dir)))


def test_hf_stops_at_the_model_end_of_turn_token(tiny) -> None:  # type: ignore[no-untyped-def]
    """A model whose generation_config names a stop id the tokenizer's EOS is not."""
    from essa.backends.generate import generate_texts

    model, tokenizer = tiny
    prompts = ["12+3=", "7+45="]
    gen = GenerationConfig(max_new_tokens=8)
    full, _ = generate_texts(model, tokenizer, prompts, gen, micro_batch_size=8)
    assert len(full[0]) > 1, "the test needs a first completion longer than one token"
    end_of_turn = tokenizer.convert_tokens_to_ids(full[0][0])  # row 0's first new token
    assert end_of_turn != tokenizer.eos_token_id
    original = copy.deepcopy(model.generation_config)
    try:
        model.generation_config.eos_token_id = [end_of_turn]
        stopped, _ = generate_texts(model, tokenizer, prompts, gen, micro_batch_size=8)
    finally:
        model.generation_config = original
    assert stopped[0] == full[0][0]  # ended on the model's own stop token
    first_stop = full[1].find(full[0][0])
    assert stopped[1] == (full[1] if first_stop < 0 else full[1][: first_stop + 1])
