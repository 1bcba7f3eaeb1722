"""Built-in arithmetic difficulty levels and the optional reasoning-gym source and reward."""

from __future__ import annotations

import importlib.util

import pytest

from essa.data import BUILTIN_SOURCES, DataError, builtin_examples, load_examples
from essa.data.arithmetic import arithmetic_examples
from essa.data.generators import ARITHMETIC_LEVELS, level_examples
from essa.rewards import get_reward
from tests.conftest import requires


def test_builtin_arithmetic_is_unchanged() -> None:
    """The bundled demo depends on this exact split."""
    assert builtin_examples("builtin:arithmetic") == arithmetic_examples()
    assert load_examples("builtin:arithmetic", split="test") == arithmetic_examples()[1]
    assert BUILTIN_SOURCES[0] == "builtin:arithmetic"


def test_the_builtin_source_names_are_the_generated_levels() -> None:
    """essa.sources names the built-in sources for the config, which imports no generators:
    the names are two-digit addition and every level of ARITHMETIC_LEVELS, in its order."""
    levels = [f"builtin:{name}" for name in ARITHMETIC_LEVELS]
    assert list(BUILTIN_SOURCES) == ["builtin:arithmetic", *levels]


def _evaluate(prompt: str) -> int:
    for op in ("+", "*"):
        if op in prompt:
            a, b = prompt.rstrip("=").split(op)
            return int(a) + int(b) if op == "+" else int(a) * int(b)
    a, b = prompt.rstrip("=").split("-", 1)
    return int(a) - int(b)


@pytest.mark.parametrize("name", sorted(ARITHMETIC_LEVELS))
def test_arithmetic_levels(name: str) -> None:
    level = ARITHMETIC_LEVELS[name]
    train = load_examples(f"builtin:{name}")
    test = load_examples(f"builtin:{name}", split="test")
    assert len(test) == level.num_test
    assert len(train) == (level.num_train or level.size - level.num_test)
    assert not {e.prompt for e in train} & {e.prompt for e in test}
    assert len({e.prompt for e in train}) == len(train)
    for example in train[:200] + test[:200]:
        assert example.answer == example.solution == str(_evaluate(example.prompt))
    # Fixed split, independent of any run seed: a fresh call gives the same lists.
    assert level_examples(name) == (train, test)


def test_arithmetic_level_contents() -> None:
    train3, test3 = level_examples("arithmetic3")
    operands = [int(x) for e in train3 + test3 for x in e.prompt.rstrip("=").split("+")]
    assert min(operands) >= 100 and max(operands) <= 999
    assert test3[0].prompt == "865+693=" and test3[0].answer == "1558"  # pinned split
    train_mixed, test_mixed = level_examples("arithmetic_mixed")
    ops = {op for e in train_mixed for op in "+-*" if op in e.prompt}
    assert ops == {"+", "-", "*"}
    assert any(e.answer.startswith("-") for e in train_mixed)
    assert test_mixed[0].prompt == "51*7=" and test_mixed[0].answer == "357"
    reward = get_reward("exact_match")
    examples = test_mixed[:5]
    assert reward([e.answer for e in examples], [e.answer for e in examples], [""] * 5) == [1.0] * 5
    with pytest.raises(DataError, match="known: builtin:arithmetic, builtin:arithmetic3"):
        load_examples("builtin:arithmetic4")


HAS_GYM = importlib.util.find_spec("reasoning_gym") is not None
GYM_SKIP = "reasoning-gym is not installed (optional [gym] extra: pip install reasoning-gym)"


@requires("gym", None if HAS_GYM else GYM_SKIP)
def test_reasoning_gym_source_and_reward() -> None:
    from essa.data.gym import GYM_NUM_TEST
    from essa.data.templates import render_prompt

    train = load_examples("reasoning_gym:basic_arithmetic", limit=50)
    test = load_examples("reasoning_gym:basic_arithmetic", split="test")
    assert len(test) == GYM_NUM_TEST and len(train) == 50
    assert not {e.prompt for e in train} & {e.prompt for e in test}
    assert load_examples("reasoning_gym:basic_arithmetic", limit=50) == train  # deterministic
    reward = get_reward("gym_score", task="basic_arithmetic")
    examples = test[:3]
    prompts = [e.prompt for e in examples]
    right = [f"<think>easy</think><answer>{e.answer}</answer>" for e in examples]
    assert reward(right, [None] * 3, prompts) == [1.0, 1.0, 1.0]
    # The task's own scorer: 1 if equal, len(gold)/len(answer) if the gold is inside, else 0.
    padded = [rf"so \boxed{{{e.answer}1}}" for e in examples]
    expected = [len(e.answer) / (len(e.answer) + 1) for e in examples]
    assert reward(padded, [None] * 3, prompts) == pytest.approx(expected)
    assert reward(["<answer>x</answer>"] * 3, [None] * 3, prompts) == [0.0, 0.0, 0.0]
    # A template-wrapped prompt still finds its entry; an unknown prompt is not gradable.
    wrapped = render_prompt("qwen_math_cot", examples[0].prompt)
    assert reward([examples[0].answer, "1"], [None, None], [wrapped, "what is 1?"]) == [1.0, None]
    with pytest.raises(DataError, match="unknown reasoning-gym task 'no_such_task'"):
        load_examples("reasoning_gym:no_such_task")


@pytest.mark.skipif(HAS_GYM, reason="checks the message shown without reasoning-gym")
def test_reasoning_gym_missing_is_a_clear_error() -> None:
    with pytest.raises(DataError, match="pip install reasoning-gym"):
        load_examples("reasoning_gym:basic_arithmetic")
