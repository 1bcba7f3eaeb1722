"""The bundled demo base model loads offline and holds addition latently (about half right)."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from essa.data.arithmetic import prompt_for, split_pairs  # noqa: E402
from essa.data.build_demo import score_pairs  # noqa: E402

DEMO_DIR = Path(str(files("essa.data") / "demo"))
NUM_SCORED = 200


@pytest.fixture(scope="module")
def demo():
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_DIR)
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEMO_DIR)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def build_info() -> dict:
    return json.loads((DEMO_DIR / "build_info.json").read_text())


def test_architecture_and_special_ids(demo, build_info):
    model, tokenizer = demo
    config = model.config
    assert config.model_type == "qwen2"
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (256, 4, 4)
    assert config.hidden_size // config.num_attention_heads == 64
    assert config.tie_word_embeddings
    assert config.vocab_size == len(tokenizer)
    # Stored as float16 but loaded as float32 by default, so CPU runs stay in full precision.
    assert next(model.parameters()).dtype == torch.float32
    assert (
        tokenizer.pad_token_id == build_info["pad_token_id"] == model.generation_config.pad_token_id
    )
    assert (
        tokenizer.eos_token_id == build_info["eos_token_id"] == model.generation_config.eos_token_id
    )
    assert tokenizer.pad_token_id != tokenizer.eos_token_id


def test_tokenizer_is_char_level_and_round_trips(demo):
    _, tokenizer = demo
    for text in ["12+34=", "0+0=0", "99+99=198", "(7 - 3) * 2.5, 1/4"]:
        ids = tokenizer(text)["input_ids"]
        assert len(ids) == len(text)
        assert tokenizer.decode(ids) == text
    assert tokenizer.padding_side == "left"
    batch = tokenizer(["1+2=", "12+34="], padding=True)
    assert batch["input_ids"][0][:2] == [tokenizer.pad_token_id] * 2
    assert batch["attention_mask"][0] == [0, 0, 1, 1, 1, 1]
    assert tokenizer.decode(batch["input_ids"][0], skip_special_tokens=True) == "1+2="


def test_greedy_answers_are_digits_ending_at_eos(demo):
    model, tokenizer = demo
    _, test = split_pairs()
    prompts = [prompt_for(a, b) for a, b in test[:8]]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        output = model.generate(**batch, max_new_tokens=5, do_sample=False)  # (8, T + 5)
    for row in output[:, batch["input_ids"].shape[1] :].tolist():
        assert tokenizer.eos_token_id in row
        answer = tokenizer.decode(row[: row.index(tokenizer.eos_token_id)])
        assert answer.isdigit() and 1 <= len(answer) <= 3


def test_addition_is_latent_on_held_out_pairs(demo, build_info):
    model, tokenizer = demo
    _, test = split_pairs()
    scores = score_pairs(model, tokenizer, test[:NUM_SCORED])
    # Neither absent nor solved: about half right, and nearly always within one.
    assert 0.3 <= scores["correct"] <= 0.7
    assert scores["off_by_one"] >= 0.25
    assert scores["correct"] + scores["off_by_one"] >= 0.85
    recorded = build_info["accuracy"]["reloaded_held_out"]["correct"]
    assert abs(scores["correct"] - recorded) <= 0.12  # 200 of the 1000 pairs: a few points of noise
