"""Rewards: table-driven extraction and verification, exact values per reward, error accounting."""

from __future__ import annotations

import math
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from essa.rewards import (
    Reward,
    combine,
    extract_answer,
    fitness_from_rewards,
    get_reward,
    known_rewards,
    last_boxed,
    normalize_gold,
)
from essa.rewards.formatting import cosine_length_value, soft_overlong_penalty
from essa.rewards.verify_worker import VerifyWorkers

# (completion, extracted answer or None)
EXTRACTION_CASES = [
    (r"so $\boxed{42}$.", "42"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"first \boxed{1} then \boxed{2}", "2"),
    (r"\boxed{\boxed{7}}", "7"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"\boxed{x^{2}+\frac{1}{x}}", r"x^{2}+\frac{1}{x}"),
    (r"\fbox{5}", "5"),
    (r"\boxed {9}", "9"),
    (r"$\boxed 3$", "3"),
    (r"ok \boxed{4} then truncated \boxed{12", "4"),
    (r"\boxed{}", None),
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
    ("#### 1,234", "1234"),
    ("The answer is 18.", "18"),
    ("So the final answer is $\\frac{3}{4}$. I hope it is correct.", r"\frac{3}{4}"),
    ("Answer: 7\nDone", "7"),
    ("the answer is: -5", "-5"),
    ("46", "46"),
    ("I computed 3 + 4 = 7 and then 7 * 2 = 14", "14"),
    ("It costs 1,500 dollars.", "1500"),
    ("the value is 3.25", "3.25"),
    ("about -0.5 units", "-0.5"),
    ("no digits at all", None),
    ("", None),
    ("\u22123 degrees", "-3"),
    ("The answer is 12 dollars.", "12"),
    ("The answer is 5 million.", "5 million"),
]


@pytest.mark.parametrize(("completion", "expected"), EXTRACTION_CASES)
def test_extract_answer(completion: str, expected: str | None) -> None:
    assert extract_answer(completion) == expected


def test_extract_without_last_number() -> None:
    assert extract_answer("it is 46", use_last_number=False) is None
    assert last_boxed("nothing") is None


@pytest.mark.parametrize(
    ("gold", "expected"),
    [
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
        ("#### 1,000", "1000"),
        (r"so the answer is $\boxed{\dfrac{1}{2}}$", r"\dfrac{1}{2}"),
        ("$5$", "5"),
        (" 12 ", "12"),
        (r"\{1,2\}", r"\{1,2\}"),
    ],
)
def test_normalize_gold(gold: str, expected: str) -> None:
    assert normalize_gold(gold) == expected


# (completion, gold answer, expected math_accuracy)
VERIFY_CASES = [
    # integers, signs, thousands separators
    (r"\boxed{42}", "42", 1.0),
    (r"\boxed{41}", "42", 0.0),
    (r"\boxed{-3}", "-3", 1.0),
    (r"\boxed{3}", "-3", 0.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{1000}", "1,000", 1.0),
    (r"\boxed{1{,}000{,}000}", "1000000", 1.0),
    ("The total is 1,234 apples.", "1234", 1.0),
    # decimals and floats stored as "27.0"
    (r"\boxed{27}", "27.0", 1.0),
    (r"\boxed{0.50}", "0.5", 1.0),
    (r"\boxed{3.14}", "3.15", 0.0),
    (r"\boxed{-0.25}", r"-\frac{1}{4}", 1.0),
    # fractions
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", 1.0),
    (r"\boxed{\tfrac{6}{8}}", "3/4", 1.0),
    (r"\boxed{3/4}", r"\frac{3}{4}", 1.0),
    (r"\boxed{\frac{2}{3}}", r"\frac{3}{2}", 0.0),
    (r"\boxed{\frac12}", "0.5", 1.0),
    (r"\boxed{0.333333}", r"\frac{1}{3}", 1.0),
    (r"\boxed{0.33}", r"\frac{1}{3}", 0.0),
    # radicals, pi, symbolic expressions
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
    (r"\boxed{\sqrt{18}}", r"3\sqrt{2}", 1.0),
    (r"\boxed{2\pi}", r"2\pi", 1.0),
    (r"\boxed{3.14}", r"\pi", 0.0),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    (r"\boxed{x^2+1}", "x^2+2x+1", 0.0),
    (r"\boxed{\infty}", r"\infty", 1.0),
    # units and text
    (r"\boxed{70 \text{ students}}", "70", 1.0),
    (r"\boxed{5\text{ cm}}", "5", 1.0),
    (r"\boxed{10^\circ}", "10", 1.0),
    (r"\boxed{\$5}", "5", 1.0),
    ("The answer is 12 dollars.", "12", 1.0),
    # percentages
    (r"\boxed{50\%}", "0.5", 1.0),
    (r"\boxed{0.5}", r"50\%", 1.0),
    (r"\boxed{25\%}", "0.5", 0.0),
    # sets, tuples, intervals, equations, choices
    (r"\boxed{\{2, 1\}}", r"\{1, 2\}", 1.0),
    (r"\boxed{\{1, 3\}}", r"\{1, 2\}", 0.0),
    (r"\boxed{(1, 2)}", "(1, 2)", 1.0),
    (r"\boxed{(2, 1)}", "(1, 2)", 0.0),
    (r"\boxed{[0, 1]}", "[0,1]", 1.0),
    (r"\boxed{(0, 1)}", "[0,1]", 0.0),
    (r"\boxed{x = 5}", "5", 1.0),
    (r"\boxed{\text{(B)}}", "B", 1.0),
    # nested boxes and the last box winning
    (r"\boxed{\boxed{7}}", "7", 1.0),
    (r"first \boxed{3}, corrected: \boxed{4}", "4", 1.0),
    (r"first \boxed{4}, corrected: \boxed{3}", "4", 0.0),
    (r"\boxed{\frac{\frac{1}{2}}{2}}", r"\frac{1}{4}", 1.0),
    # GSM8K and answer phrases
    ("She pays 3 * 4 = 12.\n#### 12", "Some work\n#### 12", 1.0),
    ("#### 13", "#### 12", 0.0),
    ("The answer is 18.", "18", 1.0),
    ("So the final answer is $\\frac{3}{4}$.", "0.75", 1.0),
    ("Answer: 7", "7", 1.0),
    (r"The answer is $\{1,2\}$.", r"\{2,1\}", 1.0),
    # plain completions and last-number fallback
    ("46", "46", 1.0),
    (" 46\n", "46", 1.0),
    ("3 + 4 = 7", "7", 1.0),
    ("3 + 4 = 8", "7", 0.0),
    # no answer
    ("I do not know.", "7", 0.0),
    ("", "7", 0.0),
    ("I do not know.", r"\frac{x}{y}", 0.0),
    # gold missing or unparseable -> not gradable
    (r"\boxed{7}", None, None),
    (r"\boxed{7}", "", None),
    (r"\boxed{7}", "#### ", None),
]


def test_verify_table_is_large_enough() -> None:
    assert len(VERIFY_CASES) + len(EXTRACTION_CASES) >= 60


@pytest.fixture(scope="module")
def accuracy() -> Reward:
    return get_reward("math_accuracy")


@pytest.mark.parametrize(("completion", "gold", "expected"), VERIFY_CASES)
def test_math_accuracy_table(
    accuracy: Reward, completion: str, gold: str | None, expected: float | None
) -> None:
    assert accuracy([completion], [gold], [""]) == [expected]


@pytest.mark.parametrize(
    ("completion", "gold"),
    [(c, g) for c, g, _ in VERIFY_CASES if g is not None and normalize_gold(g)],
)
def test_fast_path_agrees_with_math_verify(accuracy: Reward, completion: str, gold: str) -> None:
    slow = get_reward("math_accuracy", use_fast_path=False)
    assert slow([completion], [gold], [""]) == accuracy([completion], [gold], [""])


def test_math_accuracy_batch_and_stats() -> None:
    reward = get_reward("math_accuracy")
    scores = reward([r"\boxed{1}", "2", "x", r"\boxed{4}"], ["1", "3", None, "4"], [""] * 4)
    assert scores == [1.0, 0.0, None, 1.0]
    assert reward.stats.as_dict() == {"n_items": 4, "n_none": 1, "n_error": 0, "n_timeout": 0}
    assert fitness_from_rewards(scores) == pytest.approx(2 / 3)


# A power tower that sympy cannot evaluate within one second.
SLOW_PRED = r"\boxed{2^{2^{2^{2^{5}}}}}"


def test_math_accuracy_timeout_scores_zero_and_is_counted() -> None:
    reward = get_reward("math_accuracy", timeout_seconds=1)
    assert reward([SLOW_PRED], ["3"], [""]) == [0.0]
    assert reward.stats.n_timeout == 1
    assert reward.stats.n_none == 0


def test_math_accuracy_in_worker_thread() -> None:
    """Off the main thread math-verify's signal timeouts fail; the pool must give real grades
    (never the silent all-zero failure) and still bound slow items."""
    # 5 s: a real item's grade fits it on 2 cores with the suite beside it; SLOW_PRED never does.
    reward = get_reward("math_accuracy", timeout_seconds=5, num_workers=2)
    completions = [
        r"\boxed{\frac{1}{2}}",
        r"\boxed{(x+1)^2}",
        r"\boxed{\{2,1\}}",
        "#### 5",
        SLOW_PRED,
    ]
    golds = ["0.5", "x^2+2x+1", r"\{1,2\}", "6", "3"]
    results: dict[str, object] = {}

    def work() -> None:
        try:
            results["scores"] = reward(completions, golds, [""] * len(golds))
        except BaseException as error:  # surfaced by the assertion below
            results["error"] = error

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=120)
    assert "error" not in results, results
    assert results["scores"] == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert reward.stats.n_timeout == 1


def test_verify_workers_kill_a_worker_past_its_deadline() -> None:
    workers = VerifyWorkers(size=1)
    try:
        assert workers.run([("2", "2")], timeout_seconds=5, item_seconds=5.0) == [(True, "ok")]
        # Warm worker, math-verify's own alarm at 5 s, our deadline at 0.5 s: the parent kills it.
        assert workers.run([("3", SLOW_PRED[7:-1])], timeout_seconds=5, item_seconds=0.5) == [
            (False, "timeout")
        ]
        assert workers.run([(r"\frac{1}{2}", "0.5")], timeout_seconds=5, item_seconds=5.0) == [
            (True, "ok")
        ]
    finally:
        workers.close()


# ---------------------------------------------------------------------------------------------
# Other rewards: exact values from their formulas


def test_format_reward() -> None:
    boxed = get_reward("format")
    texts = [r"so \boxed{2}", "so 2", r"\boxed{}", r"<think>hm</think> \boxed{3}"]
    assert boxed(texts, [None] * 4, [""] * 4) == [1.0, 0.0, 0.0, 1.0]
    think = get_reward("format", use_boxed=False, use_think_tags=True)
    texts = [
        "<think>a</think>b",
        "<think>a</think><think>b</think>",
        "a<think>b</think>",
        "<think>a",
    ]
    assert think(texts, [None] * 4, [""] * 4) == [1.0, 0.0, 0.0, 0.0]
    both = get_reward("format", use_think_tags=True)
    assert both(["<think>a</think>\\boxed{1}", "<think>a</think>1"], ["1", "1"], ["", ""]) == [
        1.0,
        0.0,
    ]
    answer_tags = get_reward(
        "format", use_boxed=False, pattern=r"^<think>.*?</think><answer>.*?</answer>$"
    )
    assert answer_tags(
        ["<think>x</think><answer>1</answer>", "<answer>1</answer>"], ["1", "1"], ["", ""]
    ) == [1.0, 0.0]
    with pytest.raises(ValueError, match="enable"):
        get_reward("format", use_boxed=False)


def test_exact_match() -> None:
    reward = get_reward("exact_match")
    assert reward([" 46\n", "46.0", "x", "12"], ["46", "46", None, " 12 "], [""] * 4) == [
        1.0,
        0.0,
        None,
        1.0,
    ]


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (0, 0.0),
        (16_000, 0.0),
        (16_384, 0.0),
        (18_432, -0.5),
        (20_480, -1.0),
        (20_481, -1.0),
        (17_408, -0.25),
    ],
)
def test_soft_overlong_penalty_dapo(length: int, expected: float) -> None:
    assert soft_overlong_penalty(length, 20_480, 4_096) == pytest.approx(expected)


def test_overlong_reward_units() -> None:
    words = get_reward("overlong", max_length=10, cache_length=4)
    texts = ["a " * 6, "a " * 8, "a " * 10, "a " * 11]
    assert words(texts, [None] * 4, [""] * 4) == pytest.approx([0.0, -0.5, -1.0, -1.0])
    chars = get_reward("overlong", max_length=10, cache_length=4, unit="chars")
    assert chars(["x" * 7], [None], [""]) == pytest.approx([-0.25])
    tokens = get_reward("overlong", max_length=10, cache_length=4, length_fn=lambda s: 2 * len(s))
    assert tokens(["xxxx"], [None], [""]) == pytest.approx([-0.5])
    with pytest.raises(ValueError, match="cache_length"):
        get_reward("overlong", max_length=10, cache_length=20)
    with pytest.raises(ValueError, match="unit"):
        get_reward("overlong", unit="tokens")


def test_cosine_length_reward() -> None:
    assert cosine_length_value(0, 100, 0.5, 1.0) == pytest.approx(1.0)
    assert cosine_length_value(50, 100, 0.5, 1.0) == pytest.approx(0.75)
    assert cosine_length_value(500, 100, 0.5, 1.0) == pytest.approx(0.5)
    reward = get_reward("length", max_length=4)
    # lengths in words: "\boxed{1}" is 1 word, the others 2 or 4.
    texts = [r"\boxed{1}", r"so \boxed{1}", r"so \boxed{2}", r"a b c \boxed{2}", r"\boxed{1}"]
    golds = ["1", "1", "1", "1", None]
    expected = [
        0.5 + 0.25 * (1 + math.cos(math.pi / 4)),
        0.75,
        -0.75,
        -0.5,
        None,
    ]
    assert reward(texts, golds, [""] * 5) == pytest.approx(expected)


def test_random_reward_is_seeded_bernoulli() -> None:
    first = get_reward("random", p=0.3, seed=7)
    second = get_reward("random", p=0.3, seed=7)
    batch = ["x"] * 2000
    scores = first(batch, [None] * 2000, [""] * 2000)
    assert scores == second(batch, [None] * 2000, [""] * 2000)
    assert set(scores) == {0.0, 1.0}
    assert abs(sum(scores) / 2000 - 0.3) < 0.05
    other = get_reward("random", p=0.3, seed=8)(batch, [None] * 2000, [""] * 2000)
    assert other != scores
    assert get_reward("random", p=0.0)(["a"], [None], [""]) == [0.0]
    assert get_reward("random", p=1.0)(["a"], [None], [""]) == [1.0]
    with pytest.raises(ValueError, match="p must be"):
        get_reward("random", p=1.5)


def test_incorrect_label() -> None:
    reward = get_reward("incorrect_label")
    texts = [r"\boxed{3}", r"\boxed{4}", "no answer", r"\boxed{3}"]
    assert reward(texts, ["4", "4", "4", None], [""] * 4) == [1.0, 0.0, 0.0, None]


# ---------------------------------------------------------------------------------------------
# Registry, custom rewards, error isolation, combination


def test_registry_lists_known_names_on_unknown() -> None:
    assert {
        "math_accuracy",
        "format",
        "exact_match",
        "length",
        "overlong",
        "random",
        "incorrect_label",
    } <= set(known_rewards())
    with pytest.raises(ValueError, match="known rewards: .*math_accuracy"):
        get_reward("accuracy")
    with pytest.raises(ValueError, match="unknown parameter.*bogus.*accepted: .*timeout_seconds"):
        get_reward("math_accuracy", bogus=1)


def test_input_lengths_must_match() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        get_reward("exact_match")(["a", "b"], ["a"], ["", ""])


@pytest.fixture()
def custom_module(tmp_path, monkeypatch) -> str:
    source = textwrap.dedent(
        """
        def picky(completions, answers, prompts):
            out = []
            for text in completions:
                if text == "boom":
                    raise RuntimeError("cannot score")
                out.append(float(len(text)))
            return out

        def scaled(factor):
            def score(completions, answers, prompts):
                return [factor * len(text) for text in completions]
            return score

        NOT_CALLABLE = 3
        """
    )
    (tmp_path / "my_rewards.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_custom_reward_raising_item_is_none_and_counted(custom_module: str) -> None:
    reward = get_reward(f"{custom_module}:picky")
    assert reward(["ab", "boom", "abcd"], [None] * 3, [""] * 3) == [2.0, None, 4.0]
    assert reward.stats.as_dict() == {"n_items": 3, "n_none": 1, "n_error": 1, "n_timeout": 0}
    assert reward(["a"], [None], [""]) == [1.0]
    assert reward.stats.n_error == 1


def test_custom_reward_factory_and_import_errors(custom_module: str) -> None:
    assert get_reward(f"{custom_module}:scaled", factor=0.5)(["abcd"], [None], [""]) == [2.0]
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        get_reward("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        get_reward(f"{custom_module}:missing")
    with pytest.raises(ValueError, match="not callable"):
        get_reward(f"{custom_module}:NOT_CALLABLE")


def test_bad_return_values_become_counted_none() -> None:
    def wrong_length(completions, answers, prompts):
        return [1.0]

    def mixed(completions, answers, prompts):
        return [{"a": 1.0, "b": "oops", "c": math.nan, "d": True}[text] for text in completions]

    reward = Reward("wrong_length", wrong_length)
    assert reward(["a", "b"], [None, None], ["", ""]) == [1.0, 1.0]
    assert reward.stats.n_error == 0
    reward = Reward("mixed", mixed)
    assert reward(["a", "b", "c", "d"], [None] * 4, [""] * 4) == [1.0, None, None, 1.0]
    assert reward.stats.as_dict() == {"n_items": 4, "n_none": 2, "n_error": 1, "n_timeout": 0}


def test_combine_weights_and_none_handling() -> None:
    def only_first(completions, answers, prompts):
        return [1.0 if i == 0 else None for i in range(len(completions))]

    def never(completions, answers, prompts):
        return [None] * len(completions)

    both = combine([(get_reward("exact_match"), 0.9), (get_reward("format"), 0.1)])
    assert both([r"\boxed{4}", "4", "5"], ["4", "4", "4"], [""] * 3) == pytest.approx(
        [0.1, 0.9, 0.0]
    )
    assert both.name == "0.9*exact_match + 0.1*format"
    partial = combine([(Reward("first", only_first), 2.0), (Reward("never", never), 5.0)], name="p")
    assert partial(["a", "b"], [None, None], ["", ""]) == [2.0, None]
    assert partial.stats.n_none == 1
    with pytest.raises(ValueError, match="at least one"):
        combine([])


def test_fitness_from_rewards() -> None:
    assert fitness_from_rewards([1.0, 0.0, None, 1.0]) == pytest.approx(2 / 3)
    assert fitness_from_rewards([0.25]) == 0.25
    assert math.isnan(fitness_from_rewards([None, None]))
    assert math.isnan(fitness_from_rewards([]))


def test_import_is_light() -> None:
    import subprocess

    code = (
        "import sys, essa.rewards, essa.data; "
        "heavy = [m for m in ('torch', 'transformers', 'sympy', 'math_verify', 'pandas', 'pyarrow', "
        "'datasets') if m in sys.modules]; print(heavy)"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    assert out.stdout.strip() == "[]"


def test_parse_plain_number_reads_integers_and_bare_decimals() -> None:
    from fractions import Fraction

    from essa.rewards.grading import parse_plain_number

    assert parse_plain_number("5") == (Fraction(5), True)
    assert parse_plain_number(".5") == (Fraction(1, 2), True)
    assert parse_plain_number("0.1234567") == (Fraction(1234567, 10**7), False)
    assert parse_plain_number(".") is None


def test_boxed_command_at_the_end_of_the_text() -> None:
    from essa.rewards.extract import _boxed_at

    assert _boxed_at("so it is \\boxed", 9, "\\boxed") is None  # nothing after the command
    assert extract_answer("so it is \\boxed") is None  # and no IndexError
    assert extract_answer("\\boxed{12}") == "12"


def test_reward_repr_names_it() -> None:
    assert repr(get_reward("exact_match")) == "Reward('exact_match')"


def test_deadline_warns_once_then_counts(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from essa.rewards import Reward
    from essa.rewards.deadline import with_deadline

    release = threading.Event()

    def hangs(completions: list[str], answers: list, prompts: list[str]) -> list[float]:
        release.wait(30)
        return [1.0] * len(completions)

    reward = with_deadline(Reward("custom", hangs), 0.05)
    with caplog.at_level(logging.DEBUG, logger="essa.rewards.deadline"):
        reward(["a"], ["1"], ["p"])
        reward(["b"], ["1"], ["p"])
    levels = [r.levelno for r in caplog.records if "did not return" in r.message]
    assert levels == [logging.WARNING, logging.DEBUG]
    release.set()


def test_hung_reward_thread_does_not_keep_the_process_alive() -> None:
    import subprocess

    code = textwrap.dedent(
        """
        import threading
        from essa.rewards import Reward
        from essa.rewards.deadline import with_deadline

        def hangs(completions, answers, prompts):
            threading.Event().wait()  # forever

        print(with_deadline(Reward("custom", hangs), 0.05)(["a"], ["1"], ["p"]))
        """
    )
    # A non-daemon worker would block interpreter exit forever; the timeout only bounds that.
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[None]", done.stderr[-2000:]


def test_verify_workers_stop_their_processes() -> None:
    workers = VerifyWorkers(size=1)
    assert workers.run([("2", "2")], timeout_seconds=5, item_seconds=60.0) == [(True, "ok")]
    processes = list(workers._all)
    workers.close()
    assert processes and all(p.poll() is not None for p in processes)


def test_cold_worker_start_up_is_not_charged_to_the_item() -> None:
    """A fresh worker gets STARTUP_SECONDS on top of the item's own deadline (python and
    math-verify imports take far longer than the 0.05 s allowed per item here)."""
    workers = VerifyWorkers(size=1)
    try:
        assert workers.run([("2", "2")], timeout_seconds=5, item_seconds=0.05) == [(True, "ok")]
    finally:
        workers.close()


def test_reward_stats_repr_hides_its_lock() -> None:
    from essa.rewards.base import RewardStats

    assert repr(RewardStats()) == "RewardStats(n_items=0, n_none=0, n_error=0, n_timeout=0)"
    assert RewardStats() == RewardStats()  # equal counts are equal stats, whatever the lock
    assert RewardStats(n_items=1) != RewardStats()
