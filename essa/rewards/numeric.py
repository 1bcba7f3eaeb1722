"""Numbers as answers are written: one regex for a value token, its exact value, a plain form.

A *value token* is a number with what belongs to it: a sign, thousands groups (``5,000,000``,
``5 000 000``, ``10,\\!000``),
decimals, ``a/b``, scientific notation (``1e3``, ``1.5e-2``, ``2×10^3``, ``2 \\times 10^{3}``, ``1.5·10³``),
a mixed number (``3 1/2``, ``3 and 1/2``, ``3\\frac{1}{2}``, ``3½``), scale words (``5 million``, ``2 dozen``)
and a percent sign or word. :func:`canonical_number` rewrites an answer that is one such token
(and unit words) as a plain number, so that the fast path and math-verify read ``5 million`` as
5000000 and ``3 1/2`` as 3.5 (math-verify alone reads neither, and the fast path used to read
``3 1/2`` as 31/2). Pure string code, no sympy.
"""

from __future__ import annotations

import re
import unicodedata
from fractions import Fraction

_SCALE_FACTORS = {
    "hundred": 100,
    "thousand": 10**3,
    "million": 10**6,
    "billion": 10**9,
    "trillion": 10**12,
    "dozen": 12,
}
# Larger exponents or longer tokens are not numbers an answer states, and reading them would
# cost time and memory.
_MAX_EXPONENT = 100
_MAX_LENGTH = 200
# 10³, 10⁻²: superscript minus, plus and digits, read through _FROM_SUPERSCRIPT.
_SUPERSCRIPTS = "\u207b\u207a\u2070\u00b9\u00b2\u00b3\u2074-\u2079"
_FROM_SUPERSCRIPT = str.maketrans(
    "\u207b\u207a\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079", "-+0123456789"
)
_VULGAR = "\u00bc-\u00be\u2150-\u215e"  # ¼ ½ ¾ and ⅐ ... ⅞
# Between thousands groups: a comma, LaTeX's "10,\!000" and "5\,000", a thin, narrow or plain
# space ("5 000 000"; a list "2 3" has no three-digit groups).
_GROUP_SEPARATOR = r"(?:,\\!|\\,|,|[ \u00a0\u2009\u202f])"
# Integer part: thousands groups ("1,234", not "2,3") or digits; a sign only where it cannot be
# a binary minus ("10-20" is two tokens, "= -3" one).
VALUE = (
    r"(?P<sign>(?<![\w)}\]])[-+\u2212])?"
    rf"(?:(?P<int>\d{{1,3}}(?:{_GROUP_SEPARATOR}\d{{3}})+(?!\d)|\d+)(?P<dec>\.\d+)?|(?P<bare>\.\d+))"
    r"(?:(?P<exp>[eE][-+]?\d{1,3})(?!\w)"
    r"|[ \t]*(?:\\times|\\cdot|[\u00d7x*\u00b7])[ \t]*10(?:[ \t]*(?:\^|\*\*)[ \t]*"
    r"(?:\{[ \t]*(?P<pow>[-+]?\d{1,3})[ \t]*\}|(?P<pow2>[-+]?\d{1,3}))"
    rf"|(?P<sup>[{_SUPERSCRIPTS}]{{1,4}})))?"
    r"(?:(?P<over>/\d+)(?![\d/]|[.,]\d)"
    r"|(?P<mixed>(?:[ \t]+|[ \t]+and[ \t]+)\d+/\d+(?![\d/]|[.,]\d)"
    r"|[ \t]*\\[dt]?frac[ \t]*(?:\{[ \t]*\d+[ \t]*\}[ \t]*\{[ \t]*\d+[ \t]*\}|\d\d)"
    rf"|[ \t]*[{_VULGAR}]))?"
    r"(?P<scale>(?:[ \t]+(?i:hundred|thousand|million|billion|trillion|dozen)\b){0,3})"
    r"(?P<pct>[ \t]*\\?%|[ \t]+(?i:percent)\b)?"
)
VALUE_TOKEN = re.compile(VALUE)
_CURRENCY = r"(?:\\?\$|[\u20ac\u00a3\u00a5])"
# A whole answer that is one value token, with a currency sign before and unit words after.
_ONE_VALUE = re.compile(rf"\s*{_CURRENCY}?\s*(?:{VALUE})(?:\s+[A-Za-z]{{2,}}\.?)*\s*")
_TEXT_COMMAND = re.compile(r"\\(?:text|mbox|mathrm|textrm)\s*\{([^{}]*)\}")
_DIGITS = re.compile(r"\d+")
_NOT_DIGIT = re.compile(r"\D")


def _fraction_part(text: str) -> Fraction:
    """The value of a mixed number's fraction: ``1/2``, ``\\frac{1}{2}``, ``\\frac12``, ``½``."""
    text = text.strip()
    if len(text) == 1 and not text.isdigit():
        return Fraction(unicodedata.numeric(text)).limit_denominator(100)
    digits = _DIGITS.findall(text)
    if len(digits) == 1:  # \frac12
        digits = [digits[0][0], digits[0][1]]
    return Fraction(int(digits[0]), int(digits[1]))


def token_value(match: re.Match[str]) -> tuple[Fraction, bool] | None:
    """``(value, is_percent)`` of a :data:`VALUE_TOKEN` match; None when it has no exact value
    (a zero denominator, a huge exponent, a mixed number with decimals).

    >>> [token_value(VALUE_TOKEN.fullmatch(t)) for t in ("-3 1/2", "1.5e-2", "50%")]
    [(Fraction(-7, 2), False), (Fraction(3, 200), False), (Fraction(50, 1), True)]
    """
    decimal = bool(match["dec"] or match["bare"])
    exponent_text = (match["exp"] or "")[1:] or match["pow"] or match["pow2"]
    exponent_text = exponent_text or (match["sup"] or "").translate(_FROM_SUPERSCRIPT)
    exponent = int(exponent_text) if exponent_text else 0
    if abs(exponent) > _MAX_EXPONENT or (match["mixed"] and (decimal or exponent_text)):
        return None
    if len(match.group(0)) > _MAX_LENGTH:
        return None
    value = Fraction(match["bare"] or _NOT_DIGIT.sub("", match["int"]) + (match["dec"] or ""))
    value *= Fraction(10) ** exponent
    if match["over"]:
        denominator = int(match["over"][1:])
        if denominator == 0 or decimal or exponent_text:
            return None
        value /= denominator
    if match["mixed"]:
        fraction = _fraction_part(match["mixed"])
        if fraction.denominator == 0:
            return None
        value += fraction
    for word in match["scale"].lower().split():
        value *= _SCALE_FACTORS[word]
    sign = -1 if match["sign"] in ("-", "\u2212") else 1
    return sign * value, match["pct"] is not None


def plain(value: Fraction) -> str:
    """``value`` as an integer, an exact decimal, or ``a/b`` when it has no finite decimal.

    >>> plain(Fraction(7, 2)), plain(Fraction(-3, 200)), plain(Fraction(1, 3)), plain(Fraction(5))
    ('3.5', '-0.015', '1/3', '5')
    """
    if value.denominator == 1:
        return str(value.numerator)
    rest, twos, fives = value.denominator, 0, 0
    while rest % 2 == 0:
        rest, twos = rest // 2, twos + 1
    while rest % 5 == 0:
        rest, fives = rest // 5, fives + 1
    if rest != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    digits = str(abs(value.numerator) * 10**places // value.denominator).rjust(places + 1, "0")
    return ("-" if value < 0 else "") + digits[:-places] + "." + digits[-places:]


def canonical_number(answer: str) -> str:
    """``answer`` as a plain number when it is one value token written with scientific
    notation, a mixed number, a scale word, the word "percent" or thousands groups apart by
    spaces (units after it dropped); any other answer unchanged.

    >>> [canonical_number(t) for t in ("5 million", "-3 1/2", "2 \\\\times 10^{3}", "1e3 kg")]
    ['5000000', '-3.5', '2000', '1000']
    >>> canonical_number("50 percent"), canonical_number("12 dollars"), canonical_number("x+1")
    ('50%', '12 dollars', 'x+1')
    """
    text = _TEXT_COMMAND.sub(r" \1", answer)
    whole = _ONE_VALUE.fullmatch(text)
    if whole is None:
        return answer
    match = VALUE_TOKEN.search(text)
    assert match is not None  # the full match holds a token
    written = ("exp", "pow", "pow2", "sup", "mixed")
    percent_word = (match["pct"] or "").strip().lower() == "percent"
    spaced = _NOT_DIGIT.sub("", match["int"] or "") != (match["int"] or "").replace(",", "")
    if not (
        any(match[name] for name in written) or match["scale"].strip() or percent_word or spaced
    ):
        return answer  # a plain number: both graders read it as it is
    read = token_value(match)
    if read is None:
        return answer
    value, percent = read
    return plain(value) + ("%" if percent else "")
