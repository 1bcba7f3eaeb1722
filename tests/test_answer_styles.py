"""math_accuracy by answer style: one stated value scores by its value, a hedge scores 0.

Each row is (completion, gold, expected score) through ``get_reward("math_accuracy")``, with
the fast path and with math-verify alone. A style has rows that must score 1 and rows that
must score 0; the hedge rows score 0 whichever of their values the gold is.
"""

from __future__ import annotations

import pytest

from essa.rewards import Reward, extract_answer, get_reward
from essa.rewards.extract import final_statement
from essa.rewards.grading import fast_grade, parse_plain_number
from essa.rewards.hedge import is_hedged, names_one_value
from essa.rewards.numeric import canonical_number

STYLES: dict[str, list[tuple[str, str, float]]] = {
    "hedges": [
        ("The answer is 2 or 3.", "2", 0.0),
        ("The answer is 2 or 3.", "3", 0.0),
        ("It is either 7 or 8", "8", 0.0),
        ("It is either 7 or 8", "7", 0.0),
        ("The answer is 7, or maybe 8.", "7", 0.0),
        ("The answer is 7 (or possibly 8).", "7", 0.0),
        ("The answer is 7. Or maybe 8.", "7", 0.0),
        ("It could be 7. Or 8.", "8", 0.0),
        ("I think it's 7, possibly 8", "8", 0.0),
        ("The final answer is **7** or **8**.", "8", 0.0),
        ("The answer is approximately 10 or 11.", "10", 0.0),
        ("The answer is x = 2 or x = 3", "3", 0.0),
        ("So x = 2 or x = -2", "-2", 0.0),
        ("#### 7 or 8", "7", 0.0),
        ("The answer is A or B", "B", 0.0),
        ("The answer is 12 and she has 3 left", "12", 0.0),
        # one value, said twice or explained, is not a hedge
        ("The answer is 0.5, or 50%.", "0.5", 1.0),
        ("The answer is 7, which is odd.", "7", 1.0),
        ("The answer is 41, not 42.", "41", 1.0),
        ("The answer is 12, because 3 * 4 = 12.", "12", 1.0),
        ("The sum of 3 and 4 is 7", "7", 1.0),
        ("It is either 7 or 8, so I pick 8", "8", 1.0),
    ],
    "ranges": [
        ("It is between 10 and 20", "20", 0.0),
        ("The answer is between 7 and 8.", "7", 0.0),
        ("The answer is 10 to 20.", "10", 0.0),
        ("The answer is 7 to 8 hours.", "7", 0.0),
        ("The answer is from 7 to 8.", "7", 0.0),
        ("The answer is 10-20.", "20", 0.0),
        ("The answer is 2-3 hours", "2", 0.0),
        ("The answer is 7\u20138.", "8", 0.0),
        ("The answer is in the range 7-8", "7", 0.0),
        ("The answer is in the range 7-8", "8", 0.0),
        ("The answer is 7~8", "7", 0.0),
        # a change is not a range; arithmetic with a minus is not a range
        ("The price rose from 10 to 20.", "20", 1.0),
        ("The answer is 42 - 5 = 37.", "37", 1.0),
        ("The answer is 3-2\\sqrt{2}", "3-2\\sqrt{2}", 1.0),
    ],
    "lists": [
        ("The answer is 2, 3.", "2", 0.0),
        ("The answer is 7, 8, or 9.", "9", 0.0),
        ("The answer is 1,000, 2,000", "1000", 0.0),
        ("The answer is 2 3", "23", 0.0),
        ("The answer is 2 3", "2", 0.0),
        ("1 2 3 4 5", "5", 0.0),
        ("The answer is 1/2 or 1/3", "1/2", 0.0),
        # the gold itself is a list, set or tuple: math-verify compares them
        ("The answer is 3, 4", "3, 4", 1.0),
        (r"\boxed{3, 4}", "4, 3", 1.0),
        (r"\boxed{2, 3}", "2, 3", 1.0),
    ],
    "mixed numbers": [
        ("The answer is 3 1/2", "3.5", 1.0),
        ("The answer is 3 1/2", "15.5", 0.0),
        ("The answer is 3 1/2.", "3", 0.0),
        ("The answer is -3 1/2.", "-3.5", 1.0),
        ("The answer is -3 1/2.", "3.5", 0.0),
        ("The answer is 3 1/2 cups.", "7/2", 1.0),
        ("She has 3 1/2 pies left.", "3.5", 1.0),
        ("The answer is 3\u00bd.", "3.5", 1.0),
        (r"The answer is $3\frac{1}{2}$.", "3.5", 1.0),
        (r"\boxed{-3\frac{1}{2}}", "-3.5", 1.0),
        ("Total: 2 1/4 + 1 1/4 = 3 1/2", "3.5", 1.0),
        ("The answer is 2 and 1/2", "2.5", 1.0),
        ("The answer is 2 and 1/2 hours", "2", 0.0),
        ("The answer is 3-1/2", "2.5", 1.0),  # a hyphen is a minus to math-verify, not a range
    ],
    "scale words": [
        ("The answer is 5 million", "5000000", 1.0),
        ("The answer is 5 million", "5", 0.0),
        ("The answer is $5 million.", "5000000", 1.0),
        ("The answer is 5 million dollars.", "5000000", 1.0),
        ("The answer is 2.5 million.", "2500000", 1.0),
        ("It costs $1.2 billion.", "1200000000", 1.0),
        ("The answer is 5 thousand dollars.", "5000", 1.0),
        ("The answer is 3 hundred.", "300", 1.0),
        ("The answer is 2 dozen eggs.", "24", 1.0),
        ("The answer is 5 million, which is a lot.", "5000000", 1.0),
        ("The answer is 5 million.", "6000000", 0.0),
    ],
    "scientific notation": [
        ("1e3", "1000", 1.0),
        ("1e3", "3", 0.0),
        ("The answer is 1.5e-2.", "0.015", 1.0),
        ("The answer is 1E-3", "0.001", 1.0),
        ("The answer is 3.0e+3.", "3000", 1.0),
        ("The answer is 2\u00d710^3.", "2000", 1.0),
        ("The answer is 1.5 \u00d7 10^-2", "0.015", 1.0),
        (r"The answer is $1.5 \times 10^{-2}$.", "0.015", 1.0),
        (r"\boxed{2 \times 10^{3}}", "2000", 1.0),
        ("2 x 10^3", "2000", 1.0),
        ("The answer is 2 x 10**3", "2000", 1.0),
        ("The answer is 1.5\u00b710\u00b3", "1500", 1.0),
        ("The answer is 1e3 grams.", "1000", 1.0),
        ("The answer is 2\u00d710^3.", "6000", 0.0),
    ],
    "separators": [
        ("The answer is 5,000,000.", "5000000", 1.0),
        ("The answer is 5,000,000.00.", "5000000", 1.0),
        ("The answer is 1,000,000 (one million).", "1000000", 1.0),
        ("The answer is 10,\\!000.", "10000", 1.0),
        (r"\boxed{10,\!000}", "10000", 1.0),
        (r"\boxed{1{,}000{,}000}", "1000000", 1.0),
        (r"\boxed{5\,000\,000}", "5000000", 1.0),
        ("The answer is 5 000 000.", "5000000", 1.0),
        ("The answer is 5\u202f000.", "5000", 1.0),
        ("The answer is 5 000 000.", "5000", 0.0),
        ("The answer is 4,200.", "42", 0.0),
    ],
    "units": [
        ("The answer is 42 cm^2.", "42", 1.0),
        ("The answer is 42 m\u00b2.", "42", 1.0),
        ("The answer is 42\u00b0.", "42", 1.0),
        ("The answer is 42 km/h.", "42", 1.0),
        ("The answer is 42 USD.", "42", 1.0),
        ("The answer is $42/hour.", "42", 1.0),
        ("The answer is 42/x", "42", 0.0),
        ("The answer is 12 m.", "12", 1.0),
        ("The answer is 7 or 8 apples.", "7", 0.0),
        ("The answer is 12 m.", "13", 0.0),
    ],
    "percentages": [
        ("The answer is 42 %.", "42%", 1.0),
        ("The answer is 42 percent.", "0.42", 1.0),
        ("It is 50 percent.", "0.5", 1.0),
        (r"\boxed{50\%}", "0.5", 1.0),
        ("The answer is 25%.", "0.5", 0.0),
    ],
    "negative numbers": [
        ("The answer is -5.", "-5", 1.0),
        ("The answer is \u22125.", "-5", 1.0),
        ("The answer is negative 5.", "-5", 1.0),
        ("The answer is -5.", "5", 0.0),
        ("The answer is 5.", "-5", 0.0),
        (r"The answer is $x = \pm 2$.", "2", 0.0),
        (r"\boxed{\pm 2}", "2", 0.0),
    ],
    "trailing punctuation": [
        ("The answer is 42!", "42", 1.0),
        ("The answer is 42?", "42", 1.0),
        ("The answer is 42...", "42", 1.0),
        ("The answer is 42\u2026", "42", 1.0),
        ("The answer is 42;", "42", 1.0),
        ("The answer is (42).", "42", 1.0),
        ("The answer is [42]", "42", 1.0),
        ("The answer is \u201c42\u201d.", "42", 1.0),
        ("The answer is '42'.", "42", 1.0),
        ("The answer is 43!", "42", 0.0),
    ],
    "boxed": [
        (r"\boxed{2 \text{ or } 3}", "2", 0.0),
        (r"\boxed{2 \text{ or } 3}", "3", 0.0),
        (r"\boxed{7 \text{ and } 8}", "7", 0.0),
        (r"\boxed{7 \lor 8}", "8", 0.0),
        (r"\boxed{7 \, \text{or} \, 8}", "7", 0.0),
        (r"\boxed{7,8}", "7", 0.0),
        (r"\boxed{7; 8}", "8", 0.0),
        (r"\boxed{\text{(A)} \text{ or } \text{(B)}}", "B", 0.0),
        (r"$\boxed{7}$ or 8", "7", 0.0),
        (r"either 7 or $\boxed{8}$", "8", 0.0),
        (r"The answer is $\boxed{7}$.", "7", 1.0),
        (r"\boxed{\frac{7}{2}}", "3.5", 1.0),
    ],
    "multiple boxed": [
        (r"\boxed{2} or \boxed{3}", "3", 0.0),
        ("\\boxed{2}\n\\boxed{3}", "3", 0.0),
        (r"\boxed{7}, \boxed{8}", "7", 0.0),
        (r"\boxed{7} \\ \boxed{8}", "8", 0.0),
        (r"$\boxed{7}$ \quad $\boxed{8}$", "8", 0.0),
        (r"\boxed{7} (or \boxed{8})", "8", 0.0),
        (r"\boxed{7} \boxed{7}", "7", 1.0),
        (r"\boxed{\frac{1}{2}} or \boxed{0.5}", "0.5", 1.0),
        # a correction in words is not an alternative: the last box is the answer
        (r"first \boxed{3}, corrected: \boxed{4}", "4", 1.0),
        ("\\boxed{2}\n\nWait, let me recheck: 2 + 1 = 3, so \\boxed{3}", "3", 1.0),
        (r"So $x = \boxed{3}$ and $y = \boxed{9}$", "9", 1.0),
    ],
}
ROWS = [(style, *row) for style, rows in STYLES.items() for row in rows]


@pytest.fixture(scope="module")
def accuracy() -> Reward:
    return get_reward("math_accuracy")


@pytest.fixture(scope="module")
def accuracy_without_fast_path() -> Reward:
    return get_reward("math_accuracy", use_fast_path=False)


def test_every_style_has_right_and_wrong_rows() -> None:
    for style, rows in STYLES.items():
        scores = {expected for _, _, expected in rows}
        assert scores == {0.0, 1.0}, style


@pytest.mark.parametrize(("style", "completion", "gold", "expected"), ROWS)
def test_math_accuracy_by_answer_style(
    accuracy: Reward, style: str, completion: str, gold: str, expected: float
) -> None:
    assert accuracy([completion], [gold], [""]) == [expected], style


@pytest.mark.parametrize(("style", "completion", "gold", "expected"), ROWS)
def test_math_verify_alone_agrees(
    accuracy_without_fast_path: Reward, style: str, completion: str, gold: str, expected: float
) -> None:
    assert accuracy_without_fast_path([completion], [gold], [""]) == [expected], style


def test_a_hedge_scores_zero_whichever_value_is_the_gold(accuracy: Reward) -> None:
    completions = ["The answer is 2 or 3.", r"\boxed{2} or \boxed{3}", "It is between 2 and 3"]
    for gold in ("2", "3"):
        assert accuracy(completions, [gold] * 3, [""] * 3) == [0.0] * 3
    assert accuracy.stats.as_dict()["n_none"] == 0


def test_hedged_grades_say_so() -> None:
    from essa.rewards import MathVerifier

    verifier = MathVerifier()
    grades = verifier.grade(["The answer is 2 or 3.", "The answer is 2."], ["2", "2"])
    assert [(grade.correct, grade.status) for grade in grades] == [(False, "hedged"), (True, "ok")]


@pytest.mark.parametrize(
    ("answer", "plain"),
    [
        ("5 million", "5000000"),
        ("-3 1/2", "-3.5"),
        ("3 1/3", "10/3"),
        ("1e3", "1000"),
        ("1.5e-2", "0.015"),
        ("2 \\times 10^{3}", "2000"),
        ("2\u00d710^3 km", "2000"),
        ("50 percent", "50%"),
        ("3\u00bd", "3.5"),
        ("12 dollars", "12 dollars"),  # plain numbers are left to the graders as they are
        ("1e999", "1e999"),  # too large to be an answer: left alone
        ("x + 1", "x + 1"),
    ],
)
def test_canonical_number(answer: str, plain: str) -> None:
    assert canonical_number(answer) == plain


def test_the_fast_path_keeps_digits_apart_across_a_space() -> None:
    assert parse_plain_number("3 1/2") is None
    assert parse_plain_number(" 3 / 4 ") is not None
    assert fast_grade("23", "2 3") is None  # undecided: math-verify, not "equal up to spaces"


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("She ate 3 1/2 pies.", "3 1/2"),
        ("so it is 1e3", "1e3"),
        ("that is 2\u00d710^3", "2\u00d710^3"),
        ("about 5 million people", "5 million"),
        ("The answer is negative 5.", "-5"),
    ],
)
def test_the_last_number_is_the_whole_value(completion: str, expected: str) -> None:
    assert extract_answer(completion) == expected


@pytest.mark.parametrize(
    ("gold", "one"),
    [("42", True), (r"\frac{1}{2}", True), (r"3\sqrt{2}", True), ("B", True), ("5 million", True)]
    + [("2, 3", False), (r"\{1, 2\}", False), ("(1, 2)", False), (r"\pm 2", False)],
)
def test_the_rule_applies_to_one_value_golds(gold: str, one: bool) -> None:
    assert names_one_value(gold) is one


def test_long_lists_cost_linear_time() -> None:
    """A policy's long output of numbers or boxes is checked without quadratic work: each
    of these would take minutes at a pairwise comparison."""
    for text in (
        " ".join(["7"] * 20000),
        " or ".join(["\\boxed{7}"] * 5000),
        "1," * 20000,
    ):
        statement = final_statement(text)
        assert statement is not None
        assert not is_hedged(statement)
