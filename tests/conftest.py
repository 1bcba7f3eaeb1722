"""Shared fixtures: a tiny Qwen2 with a real (character-level) fast tokenizer, built in-process."""

from __future__ import annotations

from pathlib import Path

import pytest

CHARS = list("0123456789+-*= ")


def pytest_configure(config: pytest.Config) -> None:
    # Tiny test models run ~100x slower with 2 intra-op threads when the 2 cores are busy.
    import torch

    torch.set_num_threads(1)


def build_char_tokenizer() -> object:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>", *CHARS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Qwen2 (hidden 64) saved with its tokenizer; loads via Auto* classes."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    model = Qwen2ForCausalLM(config)
    out = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def svd_setup(model_dir: Path) -> tuple[object, object, object]:
    """(base model, tokenizer, SVDAdapter) of a rank-4 LoRA with random non-zero B on the tiny model."""
    import torch

    from essa.adapters import SVDAdapter
    from essa.backends.hf import load_model
    from essa.config import AdapterConfig, ModelConfig
    from essa.recipes.sft import make_lora_model

    model, tokenizer = load_model(ModelConfig(name_or_path=str(model_dir)))
    peft_model = make_lora_model(model, AdapterConfig(rank=4, lora_alpha=8))
    gen = torch.Generator().manual_seed(1)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero; a trained adapter has non-zero B
            param.data = torch.randn(param.shape, generator=gen) * 0.3
    adapter = SVDAdapter.from_peft_model(peft_model, alpha=1.0)
    return peft_model.unload(), tokenizer, adapter
