"""Regression table for answer extraction: completions as models write them, graded right.

Each row is (completion, gold, correct), graded through the public reward path
(``math_accuracy``: extraction, then the fast path or real math-verify) and, for the rows whose
extracted answer is a plain number, through ``extract_answer`` alone. Rows marked "SmolLM2" are
real completions of SmolLM2-135M-Instruct from the reasoning-gym base evaluations under
bench/results/runs/*/base_eval/; the rest are the answer styles of GSM8K and MATH chat outputs.
"""

from __future__ import annotations

import importlib.util
from fractions import Fraction

import pytest

from essa.rewards import Reward, extract_answer, get_reward, normalize_gold
from essa.rewards.extract import strip_markup
from essa.rewards.grading import parse_plain_number
from essa.rewards.gym import gym_answer

# (completion, gold, correct)
TABLE: list[tuple[str, str, bool]] = [
    # SmolLM2 on chain_sum / letter_counting (bench/results/runs/*/base_eval/*.items.jsonl)
    ("The answer is 82.", "82", True),
    ("The answer is 1.", "-2", False),
    ("The final answer to this arithmetic problem is 16.", "16", True),
    ("The final answer to this arithmetic problem is 9.", "83", False),
    ("The answer to this arithmetic problem is 2.", "-2", False),
    ("The final answer to the given arithmetic problem is 9.", "9", True),
    ("The final answer to this arithmetic problem is 125", "125", True),
    ("The answer is 16 + 60 = ", "76", False),
    ("19 - 51 = 2", "-32", False),
    ("16 + 87 = 198.", "103", False),
    ('The letter "r" appears 1 time in the text', "1", True),
    # bold, italics, underscores, code spans: around the number or the whole sentence
    ("The answer is **42**.", "42", True),
    ("The answer is **41**.", "42", False),
    ("**The answer is 42.**", "42", True),
    ("__The answer is 42__", "42", True),
    ("The answer is __42__.", "42", True),
    ("The answer is *42*.", "42", True),
    ("*The answer is 42.*", "42", True),
    ("The answer is ***42***.", "42", True),
    ("The answer is `42`.", "42", True),
    ("She has 5 apples left.\n\n**Answer:** 5", "5", True),
    ("**Answer: 5**", "5", True),
    ("**Final Answer:** 18", "18", True),
    ("**Final Answer**\n\n18", "18", True),
    ("#### **18**", "18", True),
    # an answer phrase followed by a clause, a parenthesis or more text
    ("The answer is 42, which is the number of apples she has.", "42", True),
    ("The answer is 41, not 42.", "42", False),
    ("The answer is 42 (the number of apples she has left).", "42", True),
    ("The answer is 42 (rounded to the nearest whole number).", "42", True),
    ("The answer is 2.5 hours, since 150 / 60 = 2.5.", "2.5", True),
    ("The answer is 0.5, or 50%.", "0.5", True),
    ("The answer is 18 dollars per day.", "18", True),
    ("The answer is 42 \u2014 six boxes of seven.", "42", True),
    ("Answer: The total is 42.", "42", True),
    ("The answer is approximately 3.14.", "3.14", True),
    # negatives followed by more text
    ("The answer is -12 because the balance is negative.", "-12", True),
    ("The answer is -7 (since 3 - 10 = -7).", "-7", True),
    ("The answer is **-7**, because the temperature fell.", "-7", True),
    ("The answer is \u22127, a drop of seven degrees.", "-7", True),
    ("The answer is 7, because 10 - 3 = 7.", "-7", False),
    ("The answer is -42.", "42", False),
    # GSM8K reference style and "####"
    (
        "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
        "She makes 9 * 2 = $<<9*2=18>>18 every day at the farmer's market.\n#### 18",
        "18",
        True,
    ),
    ("She makes 9 * 2 = 18 dollars.\n#### 18 dollars", "18", True),
    ("#### $1,250", "1250", True),
    ("#### Final Answer\n42", "42", True),
    ("#### 4200", "42", False),
    # boxed and LaTeX
    (r"So the total is $\boxed{18}$ dollars.", "18", True),
    (r"**Final Answer**: $\boxed{\frac{3}{4}}$", "0.75", True),
    ("The final answer is $18$. I hope it is correct.", "18", True),
    (r"The answer is $\frac{1}{2}$, which is 0.5.", "0.5", True),
    (r"The answer is \(\frac{1}{2}\).", r"\frac{1}{2}", True),
    (r"The answer is $$-\frac{3}{2}$$", "-1.5", True),
    (r"The answer is: $\boxed{41}$. Earlier I wrote 42.", "42", False),
    # units, currency, thousands separators, decimals, fractions, percent
    ("The answer is $1,234.", "1234", True),
    (r"The answer is \$1,234.50.", "1234.5", True),
    ("The answer is $42 per hour.", "42", True),
    ("The answer is 1,000,000.", "1000000", True),
    ("The answer is 4,200.", "42", False),
    ("The answer is 12.50.", "12.5", True),
    ("The answer is 0.42", "42", False),
    ("The answer is 3/4.", "0.75", True),
    ("The answer is 1/2 cup of sugar.", "0.5", True),
    ("She ate 3/4", "3/4", True),
    ("The answer is 50%.", "0.5", True),
    ("The answer is **$42**.", "42", True),
    ("The answer is: $18.00.", "18", True),
    ("The answer is -5\u00b0C, the lowest of the week.", "-5", True),
    ("The answer is 12 m.", "12", True),
    ("The answer is 12 m.", "13", False),
    ("The total cost is $\\$1,250$.", "1250", True),
    ("The total is \\$1{,}250.", "1250", True),
    ("The answer is \u20ac500, the price of the bike.", "500", True),
    ("The answer is 500\u20ac.", "500", True),
    # equations and arithmetic after the phrase: math-verify takes the right-hand side
    ("The answer is 7 + 5 = 12.", "12", True),
    ("The answer is 4 times 3 = 12.", "12", True),
    ("The answer is 42 - 5 = 37.", "42", False),
    ("The answer is x = -3.", "-3", True),
    # several numbers: the last phrase or the last number wins, an earlier gold does not count
    ("I first thought the answer is 42. Actually, the answer is 43.", "43", True),
    ("I first thought the answer is 42. Actually, the answer is 43.", "42", False),
    ("Step 1: 20 + 22 = 42\nStep 2: 42 / 2 = 21\nThe answer is 21", "21", True),
    ("Step 1: 20 + 22 = 42\nStep 2: 42 / 2 = 21\nThe answer is 21", "42", False),
    ("We need 42 apples in total. Half are eaten, so 21 remain.", "42", False),
    ("The answer is 42.\n\nCheck: 6 \u00d7 7 = 42, and 42 - 0 = 42.", "42", True),
    ("The answer is not obvious at first; computing 6 * 7 = 42.", "42", True),
    ("Thus, the final answer is: 1,000", "1000", True),
    ("Final Answer: The final answer is 42. I hope it is correct.", "42", True),
    ("Final Answer: The final answer is 42. I hope it is correct.", "24", False),
    ("The final answer: 7", "7", True),
]

HAS_GYM = importlib.util.find_spec("reasoning_gym") is not None


@pytest.fixture(scope="module")
def accuracy() -> Reward:
    return get_reward("math_accuracy")


def test_table_is_large_and_has_right_and_wrong_rows() -> None:
    assert len(TABLE) >= 40
    assert sum(correct for *_, correct in TABLE) >= 20
    assert sum(not correct for *_, correct in TABLE) >= 15


@pytest.mark.parametrize(("completion", "gold", "correct"), TABLE)
def test_math_accuracy_grades_the_table(
    accuracy: Reward, completion: str, gold: str, correct: bool
) -> None:
    assert accuracy([completion], [gold], [""]) == [float(correct)]


@pytest.mark.parametrize(
    ("completion", "gold", "correct"),
    [row for row in TABLE if parse_plain_number(normalize_gold(row[1])) is not None],
)
def test_extracted_number_equals_the_gold_exactly_when_right(
    completion: str, gold: str, correct: bool
) -> None:
    """Without math-verify: a plain-number extraction equals the gold as a number iff right
    (an equation such as "7 + 5 = 12" is left to math-verify, checked above)."""
    extracted = extract_answer(completion)
    gold_value = parse_plain_number(normalize_gold(gold))
    assert gold_value is not None
    value = _plain_value(extracted)
    if extracted is not None and value is None:
        assert "=" in extracted, extracted
        return
    assert (value == gold_value[0]) is correct, extracted


def _plain_value(answer: str | None) -> Fraction | None:
    """The value of a plain number, "50%" read as 1/2; None for anything else."""
    if answer is None:
        return None
    percent = answer.endswith("%")
    number = parse_plain_number(answer.removesuffix("%"))
    if number is None:
        return None
    return number[0] / 100 if percent else number[0]


def test_markup_is_stripped_but_arithmetic_and_subscripts_stay() -> None:
    assert strip_markup("**Answer:** **_42_**") == "Answer: 42"
    assert strip_markup("2**10 = 1024, 3 * 4 = 12, 3*4*5, x_1 + a_{n}, \\_x\\_") == (
        "2**10 = 1024, 3 * 4 = 12, 3*4*5, x_1 + a_{n}, \\_x\\_"
    )
    assert extract_answer("so 2**10 is the answer") == "10"  # nothing stripped: last number


def test_the_phrase_points_at_its_number() -> None:
    assert extract_answer("The answer is 42, which is 6 * 7.") == "42"
    assert extract_answer("The answer is -3 degrees below zero, sadly.") == "-3"
    assert extract_answer("The answer is 5 million.") == "5 million"  # scale words stay
    assert extract_answer("The answer is 42 - 5 = 37.") == "42 - 5 = 37"
    # prose without a number points at nothing: the last number decides, or nothing at all
    assert extract_answer("The answer is not obvious; 6 * 7 = 42.") == "42"
    assert extract_answer("The answer is not obvious.", use_last_number=False) == "not obvious"


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<answer>**16**</answer>", "16"),
        ("<answer> `nus` </answer>", "nus"),
        ("<answer>3*4*5</answer>", "3*4*5"),
        ("The answer is **nus**.", "nus"),
        ("The final answer to this arithmetic problem is 16.", "16"),
        ("The answer is 16, since 7 + 9 = 16.", "16"),
        (" 46\n", "46"),
    ],
)
def test_gym_answer_strips_markup_through_the_same_extraction(
    completion: str, expected: str
) -> None:
    assert gym_answer(completion) == expected


@pytest.mark.skipif(not HAS_GYM, reason="reasoning-gym is not installed (optional [gym] extra)")
def test_gym_score_gives_full_credit_to_chat_styled_right_answers() -> None:
    from essa.data import load_examples

    params = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
    examples = load_examples("reasoning_gym:chain_sum", split="test", params=params)[:3]
    reward = get_reward("gym_score", task="chain_sum", params=params)
    prompts = [e.prompt for e in examples]
    for style in (
        "The final answer to this arithmetic problem is {}.",  # SmolLM2's own phrasing
        "The answer is **{}**.",
        "<answer>**{}**</answer>",
        "The answer is {}, which is the sum.",
    ):
        completions = [style.format(e.answer) for e in examples]
        assert reward(completions, [None] * 3, prompts) == [1.0] * 3, style
    wrong = [f"The answer is **{int(e.answer) + 1}**." for e in examples]
    assert reward(wrong, [None] * 3, prompts) == [0.0] * 3
