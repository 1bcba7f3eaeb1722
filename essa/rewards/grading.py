"""Grading primitives: a numeric fast path without sympy, and math-verify on the current thread.

Kept apart from :mod:`essa.rewards.accuracy` so that verification worker processes import
only what they run.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import NamedTuple

# math-verify rounds floats to 6 places, so decimals this precise are left to it.
_FINE_DECIMAL_DIGITS = 6
_DECIMAL = re.compile(r"^[+-]?(\d+)?(?:\.(\d*))?$")
_PLAIN_FRACTION = re.compile(r"^([+-]?\d+)\s*/\s*(\d+)$")
_LATEX_FRACTION = re.compile(r"^([+-]?)\\[dt]?frac\{\s*([+-]?\d+)\s*\}\{\s*(\d+)\s*\}$")
# Longer numbers are left to math-verify, which grades them wrong: Python refuses to read
# integers of over 4300 digits, and a completion must not escape its grade that way.
_MAX_NUMBER_LENGTH = 1000
# Spaces that carry no meaning: all but those between two digits ("3 1/2" is not 31/2).
_LOOSE_SPACE = re.compile(r"\s+(?!\d)|(?<!\d)\s+")


class Grade(NamedTuple):
    """Verdict on one item. ``correct`` None = not gradable.

    ``status``: ``"ok"``, ``"no_answer"`` (nothing extracted: wrong), ``"hedged"`` (the final
    statement names several candidate values, :mod:`essa.rewards.hedge`: wrong), ``"no_gold"``
    (answer is None), ``"bad_gold"`` (the gold does not parse: None), ``"timeout"`` (wrong) or
    ``"error"`` (a verification worker died: None).
    """

    correct: bool | None
    status: str


def squeeze(text: str) -> str:
    """``text`` without its spaces, but for those between two digits.

    >>> squeeze(" 3 / 4 "), squeeze("3 1/2")
    ('3/4', '3 1/2')
    """
    return _LOOSE_SPACE.sub("", text)


def parse_plain_number(text: str) -> tuple[Fraction, bool] | None:
    """``(value, is_coarse)`` for a plain number (``-3``, ``2.50``, ``3/4``, ``\\frac{3}{4}``),
    else None. ``is_coarse`` is False for decimals with 6+ fractional digits.

    >>> parse_plain_number("-2.50")
    (Fraction(-5, 2), True)
    >>> parse_plain_number("x") is None
    True
    """
    text = squeeze(text)
    if len(text) > _MAX_NUMBER_LENGTH:
        return None
    decimal = _DECIMAL.match(text)
    if decimal is not None and (decimal.group(1) or decimal.group(2)):
        digits = decimal.group(2) or ""
        return Fraction(text), len(digits) < _FINE_DECIMAL_DIGITS
    fraction = _PLAIN_FRACTION.match(text)
    if fraction is not None and int(fraction.group(2)) != 0:
        return Fraction(int(fraction.group(1)), int(fraction.group(2))), True
    latex = _LATEX_FRACTION.match(text)
    if latex is not None and int(latex.group(3)) != 0:
        sign = -1 if latex.group(1) == "-" else 1
        return sign * Fraction(int(latex.group(2)), int(latex.group(3))), True
    return None


def fast_grade(gold: str, pred: str | None) -> Grade | None:
    """Decide without sympy where that is safe; None = undecided (use math-verify).

    Equal strings up to spaces (not those between digits: "2 3" is not 23) are correct; plain numbers compare exactly as fractions (see
    :mod:`essa.rewards.accuracy`).
    """
    if pred is not None and squeeze(gold) == squeeze(pred):
        return Grade(True, "ok")
    gold_number = parse_plain_number(gold)
    if gold_number is None:
        return None
    if pred is None:
        return Grade(False, "no_answer")
    pred_number = parse_plain_number(pred)
    if pred_number is None:
        return None
    if gold_number[0] == pred_number[0]:
        return Grade(True, "ok")
    if gold_number[1] and pred_number[1]:
        return Grade(False, "ok")
    return None


def grade_strings(gold: str, pred: str | None, timeout_seconds: int) -> tuple[bool | None, str]:
    """Grade with math-verify on the *current* thread, which must be a main thread.

    Every parse and each (gold, pred) candidate comparison is bounded by ``timeout_seconds``.
    Returns a plain ``(correct, status)`` tuple so that it crosses process boundaries cheaply.
    """
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    try:
        gold_parsed = parse(
            f"\\boxed{{{gold}}}", parsing_timeout=timeout_seconds, raise_on_error=True
        )
    except TimeoutException:
        return False, "timeout"
    except Exception:
        return None, "bad_gold"
    if not gold_parsed:
        return None, "bad_gold"
    if pred is None:
        return False, "no_answer"
    try:
        pred_parsed = parse(
            f"\\boxed{{{pred}}}", parsing_timeout=timeout_seconds, raise_on_error=True
        )
    except TimeoutException:
        return False, "timeout"
    except Exception:
        return False, "ok"
    timed_out = False
    # Pair by pair (gold first), so that one failing sympy comparison does not hide the others.
    for gold_item in gold_parsed:
        for pred_item in pred_parsed:
            try:
                if verify(
                    gold_item, pred_item, timeout_seconds=timeout_seconds, raise_on_error=True
                ):
                    return True, "ok"
            except TimeoutException:
                timed_out = True
            except Exception:
                continue
    return False, "timeout" if timed_out else "ok"
