"""``reward_model`` on tiny randomly initialised classifiers built in-process (no downloads)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from essa.rewards import get_reward

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789+-*=.,?!{}\\ ")


def build_tokenizer(with_pad: bool = True) -> object:
    """A real character-level fast tokenizer (``tokenizers`` WordLevel over single chars)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>", *CHARS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    special = {"eos_token": "<eos>", "unk_token": "<unk>"}
    if with_pad:
        special["pad_token"] = "<pad>"
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special)


@pytest.fixture(scope="module")
def qwen_rm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-label Qwen2ForSequenceClassification whose tokenizer has no pad token."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=len(CHARS) + 3,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        num_labels=1,
    )
    model = transformers.Qwen2ForSequenceClassification(config)
    out = tmp_path_factory.mktemp("tiny-qwen2-rm")
    model.save_pretrained(out)
    build_tokenizer(with_pad=False).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def bert_classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-label BertForSequenceClassification with a zero head and bias (0, ln 3)."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(CHARS) + 3,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=256,
        num_labels=2,
        pad_token_id=0,
    )
    model = transformers.BertForSequenceClassification(config)
    with torch.no_grad():
        model.classifier.weight.zero_()
        model.classifier.bias.copy_(torch.tensor([0.0, math.log(3.0)]))
    out = tmp_path_factory.mktemp("tiny-bert-clf")
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


def unbatched_logits(path: Path, prompt: str, completion: str, pair: bool) -> list[float]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    if pair:
        encoded = tokenizer(prompt, completion, return_tensors="pt")
    else:
        encoded = tokenizer(prompt + completion, return_tensors="pt")
    encoded.pop("token_type_ids", None)
    with torch.no_grad():
        return model(**encoded).logits[0].tolist()


PROMPTS = ["what is 2+2?", "what is 2+2?", "name a fruit.", "x"]
COMPLETIONS = ["4", "the answer is \\boxed{4}, since 2+2=4.", "apple", "a much longer reply here"]


@pytest.mark.parametrize("input_format", ["pair", "concat"])
def test_reward_model_batched_equals_unbatched(qwen_rm: Path, input_format: str) -> None:
    """R_i = z_i[0]: each score equals the logit of an unpadded single forward."""
    reward = get_reward("reward_model", model=str(qwen_rm), batch_size=3, input_format=input_format)
    scores = reward(COMPLETIONS, [None] * 4, PROMPTS)
    expected = [
        unbatched_logits(qwen_rm, p, c, pair=input_format == "pair")[0]
        for p, c in zip(PROMPTS, COMPLETIONS, strict=True)
    ]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(scores)) == 4  # a random model separates the inputs
    probability = get_reward(
        "reward_model", model=str(qwen_rm), output="probability", input_format=input_format
    )
    sigmoid = [1 / (1 + math.exp(-z)) for z in expected]
    assert probability(COMPLETIONS, [None] * 4, PROMPTS) == pytest.approx(sigmoid, abs=1e-5)


def test_reward_model_multi_label_exact_values(bert_classifier: Path) -> None:
    """Zero head, bias (0, ln 3): logits (0, ln 3) and softmax (1/4, 3/4) for every input."""
    logit = get_reward("reward_model", model=str(bert_classifier), label_index=1)
    assert logit(COMPLETIONS, [None] * 4, PROMPTS) == pytest.approx([math.log(3.0)] * 4)
    probability = get_reward(
        "reward_model", model=str(bert_classifier), label_index=0, output="probability"
    )
    assert probability(COMPLETIONS, [None] * 4, PROMPTS) == pytest.approx([0.25] * 4)
    with pytest.raises(ValueError, match="2 labels: set label_index"):
        get_reward("reward_model", model=str(bert_classifier))
    with pytest.raises(ValueError, match="out of range"):
        get_reward("reward_model", model=str(bert_classifier), label_index=2)
    with pytest.raises(ValueError, match="input_format"):
        get_reward("reward_model", model=str(bert_classifier), input_format="chat")


def test_reward_model_truncates(qwen_rm: Path) -> None:
    short = get_reward("reward_model", model=str(qwen_rm), input_format="concat", max_length=5)
    scores = short(["4 and more text", "4 and other"], [None] * 2, ["abcd", "abcd"])
    assert scores[0] == pytest.approx(scores[1], abs=1e-6)  # both cut to "abcd4"
