"""Hedged answers: a final statement that names several candidate values states no answer.

``math_accuracy`` grades a hedge as wrong when the gold is one value (spec rewards-and-eval.md
§2): otherwise a policy learns that "2 or 3" earns the reward whenever either is right. The
final statement is the one :func:`~essa.rewards.extract.final_statement` finds; it is a hedge
when

- it splits into pieces with different values at alternatives: "or", "either", "and",
  "between", "from", "to", "through", a comma or semicolon list (not a thousands group such as
  5,000,000), "maybe", an en dash, a range "10-20", ``\\pm``, ``\\text{ or }``, ``\\lor``,
  ``\\quad``, ``\\\\``;
  or a piece holds several numbers with only words between them ("3 apples 4 pears"). For a
  sentence after an answer phrase or ``####``, what follows a justification ("because",
  "since", "which", "not", a parenthesis, ";", ...) is left out, so that "42, which is 6 * 7"
  and "41, not 42" state one value;
- the last box or last number is chained to another value by such an alternative, or by
  nothing but spaces and punctuation: "\\boxed{2} or \\boxed{3}", "\\boxed{2}\\n\\boxed{3}",
  "either 7 or 8", "between 10 and 20" (but "first \\boxed{3}, corrected: \\boxed{4}" and
  "from 10 to 20" after a change verb are a correction, not alternatives);
- the next sentence offers another value: "The answer is 2. Or maybe 3."

Values compare exactly (:mod:`essa.rewards.numeric`: 0.5, "50%", "1/2" and "\\frac{1}{2}" are one
value; "50%" also equals 50, as math-verify reads it), other pieces as strings without spaces.
"""

from __future__ import annotations

import bisect
import itertools
import re
from dataclasses import dataclass
from fractions import Fraction

from essa.rewards.extract import FinalStatement, boxes, last_boxed, strip_markup
from essa.rewards.grading import parse_plain_number
from essa.rewards.numeric import VALUE_TOKEN, token_value

# A piece's value: the numbers it may equal, or its text without spaces (an expression).
Key = frozenset[Fraction] | str


class _Several:
    """A piece that names several values by itself ("2 3", "\\pm 2", "10-20")."""


SEVERAL = _Several()


@dataclass(frozen=True)
class _Box:
    content: str


# A value in a text: its span and what to read its key from (a value token or a box).
_Item = tuple[int, int, "re.Match[str] | _Box"]

_TEXT_COMMAND = re.compile(
    r"\\(?:text|textbf|textit|mbox|mathrm|textrm|operatorname)\s*\{([^{}]*)\}"
)
_LATEX_OR = re.compile(r"\\(?:lor|vee)(?![A-Za-z])")
_LATEX_QUAD = re.compile(r"\\q?quad(?![A-Za-z])")
_LATEX_SPACE = re.compile(r"\\[,!;: ]")
_MATH_DELIMITER = re.compile(r"\\?\$|\\[()\[\]]")
# Where a sentence's justification starts; a parenthesis that opens an alternative stays.
_JUSTIFICATION = re.compile(
    r"\s*(?:\((?!\s*(?:or|either|maybe|perhaps|possibly|probably)\b)|[;\u2014]|\\approx|\u2248"
    r"|,?\s+(?:because|since|as|which|who|where|when|whereas|given|due|i\.e\.|e\.g\.|that is"
    r"|not|rather than|instead of|if|so that|hence|thus|therefore)\b"
    r"|,\s*(?:or\s+)?(?:approximately|about|roughly|around|nearly|almost)\b)",
    re.IGNORECASE,
)
_SEPARATOR = re.compile(
    r";|,(?!\d{3}(?!\d))|\u2013|(?<=\d)\s*~\s*(?=\d)"
    r"|\b(?:or|and/or|and|to|through|thru|versus|vs|either|between|from|otherwise"
    r"|alternatively|maybe|perhaps|possibly|probably)\b",
    re.IGNORECASE,
)
_PLUS_MINUS = re.compile(r"\\pm(?![A-Za-z])|\\mp(?![A-Za-z])|\u00b1")
_RANGE = re.compile(r"\s*(\d[\d,]*(?:\.\d+)?)-(\d[\d,]*(?:\.\d+)?)(?:\s+[A-Za-z]{2,})*\s*")
# What may surround the one number of a piece: unit words, prose, currency, degrees, percent.
_AROUND_NUMBER = re.compile(r"[\sA-Za-z$\u20ac\u00a3\u00a5\u00b0%'\".,:]*")
_WORD = re.compile(r"[A-Za-z]+")
_MATH_WORDS = {"times", "plus", "minus", "over", "divided", "multiplied", "mod", "pi", "sqrt"}
_NUMBERLESS_VALUE = re.compile(r"\\[A-Za-z]+|\(?[A-Za-z]\)?")
# Between two values: only spaces and punctuation, or an alternative ("or", "to", "-", ...).
_ALTERNATIVE_GAP = re.compile(
    r"[\s,;/.(]*(?:(?:or|and/or|and|either|to|through|thru|versus|vs|maybe|perhaps"
    r"|possibly|probably|alternatively|otherwise)\b[\s,:(]*)*"
    r"|\s+(?:[A-Za-z]{2,}\s+){1,2}(?:or|to)\s+(?:(?:maybe|perhaps|possibly)\s+)?"
    r"|[\s,;]*(?:or|and/or)\s+[A-Za-z](?:_\w+)?\s*=\s*"  # "x = 2 or x = -2", not "and y = 9"
    r"|\s*[\u2013~]\s*|-",
    re.IGNORECASE,
)
_TO_GAP = re.compile(r"\s+(?:[A-Za-z]{2,}\s+){0,2}to\s+", re.IGNORECASE)
_FROM_BEFORE = re.compile(r"\bfrom\s*$", re.IGNORECASE)
_HEDGE_OPENING = re.compile(
    r"[\s.,;:!?)\-\u2014]*(?:or|alternatively|otherwise|maybe|perhaps|possibly|unless|else"
    r"|either)\b",
    re.IGNORECASE,
)
_SENTENCE_END = re.compile(r"[.!?](?=\s)|\n")


def clean(text: str) -> str:
    """``text`` with formatting-only LaTeX and Markdown removed: ``\\text{ or }`` becomes
    " or ", ``\\lor`` "or", ``\\quad`` a comma, thin spaces and ``$`` delimiters go.

    >>> " ".join(clean(r"$2 \\text{ or } 3$, **4**\\quad 10,\\!000").split())
    '2 or 3 , 4, 10,000'
    """
    text = _TEXT_COMMAND.sub(r" \1 ", text)
    text = _LATEX_OR.sub(" or ", text)
    text = _LATEX_QUAD.sub(", ", text)
    text = text.replace("\\\\", " ")  # a LaTeX line break
    text = _LATEX_SPACE.sub("", text)
    text = _MATH_DELIMITER.sub(" ", text)
    return strip_markup(text.replace("\u2212", "-").replace("{,}", ","))


def _squeezed(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _token_key(match: re.Match[str]) -> Key | None:
    read = token_value(match)
    if read is None:
        return None
    value, percent = read
    return frozenset({value, value / 100}) if percent else frozenset({value})


def _many_numbers_key(piece: str, tokens: list[re.Match[str]]) -> Key | _Several:
    """Several numbers in one piece: several values when only words lie between them
    ("3 apples 4 pears", "2 3"), else one expression ("16 + 60", "2\\sqrt{3}")."""
    pairs = list(itertools.pairwise(tokens))
    gaps = [piece[a.end() : b.start()] for a, b in pairs]
    words = {word.lower() for gap in gaps for word in _WORD.findall(gap)}
    if all(re.fullmatch(r"[\sA-Za-z]*", gap) for gap in gaps) and not words & _MATH_WORDS:
        return SEVERAL
    if all(gap == "-" and _whole(a) and _whole(b) for gap, (a, b) in zip(gaps, pairs, strict=True)):
        return SEVERAL  # a range "in the range 7-8" (but "3-1/2" or "3-2\sqrt{2}" is arithmetic)
    return _squeezed(piece)


def _whole(token: re.Match[str]) -> bool:
    """A token without a fraction part: a range's end."""
    return not (token["over"] or token["mixed"])


def piece_key(piece: str) -> Key | _Several | None:
    """The value one piece of a statement names; None when it names none ("the nearest").

    >>> [piece_key(p) for p in ("x = 2", "she has 3 left", "2\\\\sqrt{3}", "the nearest")]
    [frozenset({Fraction(2, 1)}), frozenset({Fraction(3, 1)}), '2\\\\sqrt{3}', None]
    """
    if "=" in piece:  # an equation states its right-hand side: "x = 2", "7 + 5 = 12"
        right = piece.rsplit("=", 1)[1]
        if VALUE_TOKEN.search(right) or _NUMBERLESS_VALUE.search(right):
            piece = right
    piece = piece.strip(" \t\n,:()[]").rstrip(".")
    if _PLUS_MINUS.search(piece):
        return SEVERAL
    span = _RANGE.fullmatch(piece)
    if span is not None and span.group(1) != span.group(2):
        return SEVERAL
    number = parse_plain_number(piece)  # \frac{1}{2}, 3/4
    if number is not None:
        return frozenset({number[0]})
    tokens = list(VALUE_TOKEN.finditer(piece))
    if not tokens:
        return _squeezed(piece) if _NUMBERLESS_VALUE.fullmatch(piece.strip()) else None
    if len(tokens) > 1:
        return _many_numbers_key(piece, tokens)
    around = piece[: tokens[0].start()] + " " + piece[tokens[0].end() :]
    words = {word.lower() for word in _WORD.findall(around)}
    letters = [word for word in _WORD.findall(around) if len(word) == 1]
    if _AROUND_NUMBER.fullmatch(around) and not words & _MATH_WORDS and not letters:
        return _token_key(tokens[0]) or _squeezed(piece)
    return _squeezed(piece)  # an expression: "3x", "2^{10}", "\sqrt{2}"


def pieces(text: str, *, justified: bool = False) -> list[Key | _Several]:
    """The values the pieces of ``text`` name, pieces without a value left out. With
    ``justified`` (a sentence), what follows a justification is cut off first."""
    text = clean(text)
    if justified:
        cut = _JUSTIFICATION.search(text)
        text = text[: cut.start()] if cut else text
    keys = [piece_key(piece) for piece in _split(text)]
    return [key for key in keys if key is not None]


def _split(text: str) -> list[str]:
    """``text`` split at the separators that are not inside a value token ("2 and 1/2")."""
    spans = [(match.start(), match.end()) for match in VALUE_TOKEN.finditer(text)]
    starts = [start for start, _ in spans]
    parts, last = [], 0
    for separator in _SEPARATOR.finditer(text):
        token = bisect.bisect_right(starts, separator.start()) - 1
        if token >= 0 and separator.start() < spans[token][1]:
            continue
        parts.append(text[last : separator.start()])
        last = separator.end()
    return [*parts, text[last:]]


def _same(a: Key, b: Key) -> bool:
    if isinstance(a, frozenset) and isinstance(b, frozenset):
        return bool(a & b)
    return a == b


def _differ(keys: list[Key | _Several]) -> bool:
    """Some key names several values, or two keys name different ones."""
    if any(isinstance(key, _Several) for key in keys):
        return True
    distinct: list[Key] = list(dict.fromkeys(keys))  # type: ignore[arg-type]
    if any(not _same(distinct[0], key) for key in distinct[1:]):
        return True  # found early, so that a long list costs linear time
    return any(not _same(a, b) for a, b in itertools.combinations(distinct, 2))


def names_one_value(gold: str) -> bool:
    """The gold is one value (not a list, set, tuple, interval or "\\pm"): the hedge rule
    applies.

    >>> names_one_value("42"), names_one_value(r"\\frac{1}{2}"), names_one_value("2, 3")
    (True, True, False)
    """
    keys = pieces(gold)
    return len(keys) <= 1 and not any(isinstance(key, _Several) for key in keys)


def _chain_differs(text: str, items: list[_Item], final: int) -> bool:
    """An item chained to ``items[final]`` by alternative gaps, either way, names another value
    (the walk stops there, so that a long chain of equal values costs linear time)."""
    answer = _item_key(items[final][2])
    for step in (-1, 1):
        i = final
        while 0 <= i + step < len(items):
            left, right = sorted((items[i], items[i + step]), key=lambda item: item[0])
            if not _is_alternative(text, left, right):
                break
            i += step
            if _differ([answer, _item_key(items[i][2])]):
                return True
    return isinstance(answer, _Several)


def _item_key(item: re.Match[str] | _Box) -> Key | _Several:
    """The key of a chain item, read only when the chain reaches it (a long list of numbers
    would otherwise cost a Fraction each)."""
    if isinstance(item, _Box):
        return _box_key(item.content)
    key = _token_key(item)
    return key if key is not None else _squeezed(item.group(0))


def _is_alternative(text: str, left: _Item, right: _Item) -> bool:
    gap = text[left[1] : right[0]]
    if not (_ALTERNATIVE_GAP.fullmatch(gap) or _ALTERNATIVE_GAP.fullmatch(clean(gap))):
        return False
    if gap == "-" and not all(isinstance(x, re.Match) and _whole(x) for x in (left[2], right[2])):
        return False  # "3-1/2" is arithmetic to math-verify, not a range
    # "rose from 10 to 20" is a change, not a range of answers.
    return not (_TO_GAP.fullmatch(gap) and _FROM_BEFORE.search(text[: left[0]]))


def _value_items(text: str, start: int, end: int) -> list[_Item]:
    return [(match.start(), match.end(), match) for match in VALUE_TOKEN.finditer(text, start, end)]


def _box_key(content: str) -> Key | _Several:
    inner = last_boxed(content)
    content = inner if inner is not None else content
    key = piece_key(clean(content))
    return key if key is not None else _squeezed(content)


def _boxed_hedge(statement: FinalStatement) -> bool:
    """Several values in the last box, or boxes and numbers of its line chained to it."""
    if _differ(pieces(statement.text)):
        return True
    text = statement.source
    line_start = text.rfind("\n", 0, statement.start) + 1
    line_end = text.find("\n", statement.end)
    line_end = len(text) if line_end < 0 else line_end
    spans = boxes(text)
    starts = [start for start, _, _ in spans]
    items: list[_Item] = [(start, end, _Box(content)) for start, end, content in spans]
    for item in _value_items(text, line_start, line_end):
        box = bisect.bisect_right(starts, item[0]) - 1
        if box < 0 or item[0] >= spans[box][1]:  # not inside a box
            items.append(item)
    items.sort(key=lambda item: item[0])
    final = bisect.bisect_right([item[0] for item in items], statement.start) - 1
    return final >= 0 and _chain_differs(text, items, final)


def _last_number_hedge(statement: FinalStatement) -> bool:
    """The last number chained to another value in its sentence, or its sentence opening
    with a hedge ("Or 8.") after a sentence that ends on another value."""
    items = _value_items(statement.source, statement.start, statement.end)
    if not items:
        return False
    if _chain_differs(statement.source, items, len(items) - 1):
        return True
    if not _HEDGE_OPENING.match(statement.text):
        return False
    earlier = _value_items(statement.source, 0, statement.start)
    return bool(earlier) and _differ([_item_key(earlier[-1][2]), _item_key(items[-1][2])])


def _sentence_hedge(statement: FinalStatement) -> bool:
    """Several values in the sentence after the marker or phrase, or a next sentence that
    opens with a hedge and names another value."""
    if _differ(pieces(statement.text, justified=True)):
        return True
    after = statement.source[statement.end :]
    opening = _HEDGE_OPENING.match(after)
    if opening is None:
        return False
    end = _SENTENCE_END.search(after, opening.end())
    offered = pieces(after[opening.end() : end.start() if end else len(after)], justified=True)
    answer = piece_key(clean(statement.answer))
    return answer is not None and any(_differ([answer, key]) for key in offered)


def is_hedged(statement: FinalStatement) -> bool:
    """The final statement names more than one candidate value (see the module docstring).

    >>> from essa.rewards.extract import final_statement
    >>> [is_hedged(final_statement(t)) for t in ("The answer is 2 or 3.", "It is 7 or 8",
    ...     r"\\boxed{2} \\boxed{3}", "The answer is 5,000,000.", "The answer is 42, not 41.")]
    [True, True, True, False, False]
    """
    if statement.kind == "boxed":
        return _boxed_hedge(statement)
    if statement.kind == "last":
        return _last_number_hedge(statement)
    return _sentence_hedge(statement)
