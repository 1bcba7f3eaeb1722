"""Templates against real tokenizers built in-process: BOS, ChatML tokens, system prompts;
and reasoning_gym task parameters (data.params)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from essa.config import ConfigError, load_config
from essa.data.templates import adds_bos, render_prompt, render_prompts
from tests.conftest import build_char_tokenizer

CHAT = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA_CHAT = (
    "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def llama_style_tokenizer() -> object:
    """A character-level tokenizer whose post-processor puts <s> first, as Llama's does."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = list("0123456789+-*= abcdefghijklmnopqrstuvwxyz[]")
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<s>", "</s>", "<unk>", *chars])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )


def test_bos_kept_for_tokenizers_that_add_it() -> None:
    tokenizer = llama_style_tokenizer()
    assert adds_bos(tokenizer) and not adds_bos(build_char_tokenizer())
    text = render_prompt("raw", "1+2=", tokenizer)
    assert text == "<s>1+2="
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # as the backends encode
    assert ids == tokenizer("1+2=")["input_ids"] and ids[0] == tokenizer.bos_token_id
    tokenizer.chat_template = LLAMA_CHAT  # writes its own BOS: not doubled
    (chat,) = render_prompts("chat", ["1+2="], tokenizer)
    assert chat.startswith("<s>[user]") and chat.count("<s>") == 1
    assert render_prompt("raw", "1+2=", build_char_tokenizer()) == "1+2="  # no BOS: unchanged


def test_chatml_template_needs_chatml_tokens() -> None:
    tokenizer = build_char_tokenizer()
    with pytest.raises(ValueError, match=r"writes ChatML, but the tokenizer has no <\|im_start\|>"):
        render_prompts("qwen_math_cot", ["1+1"], tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    (text,) = render_prompts("qwen_math_cot", ["1+1"], tokenizer)
    assert text.startswith("<|im_start|>system")
    assert render_prompt("qwen_math_cot", "1+1") == text  # no tokenizer: no check, same text


def test_system_prompt_for_chat_template() -> None:
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    with_system = render_prompt("chat", "1+1", tokenizer, system_prompt="Be brief.")
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user")
    assert render_prompt("chat", "1+1", tokenizer).startswith("<|im_start|>user")
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        render_prompt("chat", "1+1", build_char_tokenizer())
    with pytest.raises(ValueError, match="applies to template 'chat' only"):
        render_prompt("raw", "1+1", tokenizer, system_prompt="Be brief.")
    with pytest.raises(ConfigError, match="^--set data.system_prompt: data.system_prompt: applies"):
        load_config(None, ["data.system_prompt=Be brief."])
    assert load_config(None, ["data.template=chat", "data.system_prompt=x"]).data.system_prompt


def test_reasoning_gym_params(tmp_path: Path) -> None:
    pytest.importorskip("reasoning_gym")
    from essa.data import DataError, load_examples

    easy = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    examples = load_examples("reasoning_gym:basic_arithmetic", split="test", params=easy)

    def longest_number(examples: list) -> int:
        return max(len(n) for e in examples for n in re.findall(r"\d+", e.prompt))

    assert longest_number(examples) == 1, examples[:3]  # "Calculate 2 + 0."
    default = load_examples("reasoning_gym:basic_arithmetic", split="test")
    assert longest_number(default) >= 4
    with pytest.raises(
        DataError,
        match=r"data.params.difficulty: not a parameter of "
        r"basic_arithmetic \(known: min_terms, max_terms",
    ):
        load_examples("reasoning_gym:basic_arithmetic", params={"difficulty": 2})
    with pytest.raises(DataError, match="max_digits must be >= min_digits"):
        load_examples("reasoning_gym:basic_arithmetic", params={"min_digits": 3, "max_digits": 2})


def test_data_params_config_checks() -> None:
    with pytest.raises(ConfigError, match="only reasoning_gym:TASK sources take parameters"):
        load_config(None, ["data.params={max_digits: 2}"])
    gym = ["data.source=reasoning_gym:basic_arithmetic", "data.params={max_digits: 2}"]
    load_config(None, gym)
    with pytest.raises(ConfigError, match="gym_score regenerates the task"):
        load_config(None, [*gym, "reward.name=gym_score", "reward.params={task: basic_arithmetic}"])
    both = "reward.params={task: basic_arithmetic, params: {max_digits: 2}}"
    load_config(None, [*gym, "reward.name=gym_score", both])


def test_gym_score_grades_with_the_same_params() -> None:
    pytest.importorskip("reasoning_gym")
    from essa.data import load_examples
    from essa.rewards import get_reward

    easy = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    examples = load_examples("reasoning_gym:basic_arithmetic", split="test", params=easy)[:4]
    reward = get_reward("gym_score", task="basic_arithmetic", params=easy)
    prompts = [e.prompt for e in examples]
    assert reward([e.answer for e in examples], [None] * 4, prompts) == [1.0] * 4
