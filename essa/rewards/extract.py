"""Answer extraction from completions and gold normalisation (pure string code, no sympy).

Extraction order of :func:`extract_answer` (spec rewards-and-eval.md §2, the Qwen2.5-Math
``extract_answer`` fallback chain with a GSM8K step added):

1. the last brace-matched ``\\boxed{...}`` (``\\fbox{...}`` when there is no ``\\boxed``);
2. the text after the last GSM8K ``#### `` marker;
3. the text after the last answer phrase: "the answer is", "final answer is", "Answer:",
   "the answer to this problem is";
4. the last number in the text (``use_last_number``), so that a bare completion like "46" grades;
   a number is read whole (:data:`~essa.rewards.numeric.VALUE_TOKEN`: ``3 1/2``, ``1e3``,
   ``2×10^3``, ``5 million``, ``50%``).

:func:`final_statement` says where the answer was found (the box, or the sentence after the
marker or phrase, or the sentence of the last number), which :mod:`essa.rewards.hedge` reads.

Steps 2-4 read the completion with its Markdown emphasis removed (``**42**``, ``*42*``,
``__42__``, `` `42` ``; not ``2**10`` or ``x_1``). What follows a marker or phrase is cut to its
sentence and then to the answer it points at (:func:`pointed_answer`): a leading number with its
trailing clause, parenthesis or unit words dropped (``42, which ...`` -> ``42``), else a leading
``$...$`` span, else, for prose (``that she has 5 apples``), its last number. A phrase whose prose
holds no number points at nothing, and the next step decides.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from essa.rewards.numeric import VALUE, VALUE_TOKEN

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_GSM8K_MARKER = re.compile(r"####[ \t]*([^\n]*)")
# "the answer is", "final answer is", "The final answer: ", DAPO's "Answer:", and the chat
# models' "The answer to this arithmetic problem is".
_ANSWER_PHRASE = re.compile(
    r"answer(?:\s+(?:to|for)\s+[^.\n:]{1,60}?)?\s*(?:is\b\s*:?|:)[ \t]*", re.IGNORECASE
)
# A Markdown heading after the GSM8K marker ("#### Final Answer") is not the answer.
_ANSWER_HEADING = re.compile(r"(?:the\s+)?(?:final\s+)?answer\b\s*(?:is\b)?\s*:?\s*", re.I)
# Emphasis opens after a non-word character and closes before one, within 300 characters of
# one line (a bound that keeps degenerate "(*(*(*..." text linear), so that "2**10", "3 * 4",
# "x_1", "a_{n}" and "\_" are left alone.
_EMPHASIS = re.compile(
    r"(?<![\w\\*_`])(\*{1,3}|_{1,3}|`)(?=\S)(.{1,300}?)(?<=[^\s\\])\1(?![\w*_`({\[])"
)
_EMPHASIS_DEPTH = 3  # "**_`42`_**" at most
# The number an answer starts with (a value token: "3/4", "3 1/2", "5 million", "1e3", "50%"),
# its currency sign dropped.
_LEADING_NUMBER = re.compile(rf"(?:\\?\$|[\u20ac\u00a3\u00a5])?[ \t]*(?P<token>{VALUE})")
_PERCENT = re.compile(r"\s*\\?%$")
# What ends the answer after its number: a clause (not a list: "2, 3 and 5"), a parenthesis,
# an em dash, a degree or currency sign, or the end.
_AFTER_NUMBER = re.compile(
    r"\s*$|[,;:](?:\s+[^\s\d+-]|\s*$)|\s+\(|\s*[\u2014\u00b0\u20ac\u00a3\u00a5]"
    r"|\s*/\s*[A-Za-z]{2,}"  # a rate unit: "$42/hour" (not "42/x")
)
# The word after the number, and whether the sentence ends or a clause opens right after it.
_NEXT_WORD = re.compile(r"\s+([A-Za-z]+)(?![A-Za-z])(\s*$|[,;:(]|[\u00b2\u00b3]\s*$)?")
# Words after a number that belong to the answer ("5 million", "4 times 3 = 12", "2 pi").
_MATH_WORDS = {"times", "plus", "minus", "over", "divided", "multiplied", "mod", "pi", "sqrt"}
# Prose after a phrase: a word, then a space ("that she has 5 apples", "approximately 42").
_PROSE = re.compile(r"[A-Za-z]{2,},?\s")
_MATH_SPAN = re.compile(r"(\$\$?|\\\(|\\\[)(.+?)(\$\$?|\\\)|\\\])")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_SENTENCE_END = re.compile(r"\.(?:\s|$)")
_QUOTES = "\"'\u201c\u201d\u2018\u2019"
# "negative 5" is -5 ("minus" is not: "10 minus 5" is arithmetic).
_NEGATIVE_WORD = re.compile(r"\bnegative\s+(?=\.?\d)", re.IGNORECASE)
# Where a sentence ends around the last number: a full stop, "!" or "?" before a space, a line end.
_BOUNDARY = re.compile(r"[.!?](?=\s)|\n")
# "12 dollars" -> "12": a number followed only by plain words (units); math-verify knows few
# unit words and would read "dollars" as a product of symbols.
_NUMBER_THEN_WORDS = re.compile(r"^(-?\d[\d,]*(?:\.\d+)?)\s+([A-Za-z]{3,}(?:\s+[A-Za-z]{3,})*)$")
_SCALE_WORDS = {"hundred", "thousand", "million", "billion", "trillion", "dozen", "percent"}


def _braced_content(text: str, open_index: int) -> str | None:
    """Content of the brace group opening at ``text[open_index] == "{"``, or None if unbalanced."""
    depth = 0
    for i in range(open_index, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : i]
    return None


def _boxed_at(text: str, start: int, command: str) -> tuple[str, int] | None:
    """Content and end of the box command starting at ``start``: ``\\boxed{...}`` or
    ``\\boxed x``; None if it is unbalanced or another command."""
    j = start + len(command)
    if j < len(text) and text[j].isalpha():  # e.g. "\boxedx" is another command
        return None
    while j < len(text) and text[j] == " ":
        j += 1
    if j < len(text) and text[j] == "{":
        content = _braced_content(text, j)
        return None if content is None else (content, j + len(content) + 2)
    if j > start + len(command):  # "\boxed 5$": up to the closing dollar or end of line
        match = re.match(r"[^$\n]+", text[j:])
        return (match.group(0).strip(), j + match.end()) if match else None
    return None


def _last_box(text: str) -> tuple[int, int, str] | None:
    """``(start, end, content)`` of the last balanced box (see :func:`last_boxed`)."""
    for command in _BOX_COMMANDS:
        end = len(text)
        while (start := text.rfind(command, 0, end)) >= 0:
            found = _boxed_at(text, start, command)
            if found is not None:
                return start, found[1], found[0]
            end = start
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last balanced ``\\boxed{}`` (brace-matched), falling back to ``\\fbox{}``.

    Unbalanced boxes (a truncated completion) are skipped in favour of an earlier complete one.

    >>> last_boxed(r"so \\boxed{\\frac{1}{2}} and \\boxed{\\{1, 2\\}}")
    '\\\\{1, 2\\\\}'
    >>> last_boxed("no box") is None
    True
    """
    box = _last_box(text)
    return None if box is None else box[2]


def boxes(text: str) -> list[tuple[int, int, str]]:
    """``(start, end, content)`` of every balanced, outermost ``\\boxed``/``\\fbox``, in order.

    >>> [box[2] for box in boxes(r"\\boxed{2} or \\fbox{\\boxed{3}}, \\boxed{4")]
    ['2', '\\\\boxed{3}']
    """
    found: list[tuple[int, int, str]] = []
    for match in re.finditer(r"\\(?:boxed|fbox)", text):
        if found and match.start() < found[-1][1]:
            continue  # inside the previous box
        box = _boxed_at(text, match.start(), match.group(0))
        if box is not None:
            found.append((match.start(), box[1], box[0]))
    return found


def strip_markup(text: str, *, whole: bool = False) -> str:
    """``text`` without Markdown emphasis and code spans: ``**42**``, ``*42*``, ``__42__``,
    ``***42***`` and `` `42` `` become ``42``; ``2**10``, ``3 * 4`` and ``x_1`` stay. With
    ``whole``, only emphasis around all of ``text`` goes (an exact answer inside a tag).

    >>> strip_markup("**The answer is __42__.** 2**10 = 3 * x_1")
    'The answer is 42. 2**10 = 3 * x_1'
    >>> strip_markup("*a* or *b*", whole=True), strip_markup("**_nus_**", whole=True)
    ('*a* or *b*', 'nus')
    """
    for _ in range(_EMPHASIS_DEPTH):  # nested emphasis: "**_42_**"
        previous = text
        if not whole:
            text = _EMPHASIS.sub(r"\2", text)
        else:  # the first closing delimiter must end the text: not "*a* or *b*"
            match = _EMPHASIS.match(text.strip())
            if match is not None and match.end() == len(text.strip()):
                text = match.group(2)
        if text == previous:
            break
    return text


def _sentence_span(rest: str) -> tuple[str, int]:
    """The first sentence of the first line of ``rest``, trailing punctuation dropped, and
    where it ends in ``rest``."""
    line = rest.split("\n", 1)[0]
    end = _SENTENCE_END.search(line)
    length = end.start() if end is not None else len(line)
    return line[:length].strip().rstrip(".,;:!?\u2026").strip().strip(_QUOTES).strip(), length


def _sentence(rest: str) -> str:
    """The first sentence of the first line of ``rest``, trailing punctuation dropped."""
    return _sentence_span(rest)[0]


def _leading_number(answer: str) -> str | None:
    """The number ``answer`` starts with when what follows it is no part of it: nothing, a
    clause, a parenthesis or plain words ("42, which ...", "-7 (since ...)", "12 dollars");
    None when the number is part of a larger answer ("3/4", "5 million", "42 - 5 = 37")."""
    match = _LEADING_NUMBER.match(answer)
    if match is None:
        return None
    number = _PERCENT.sub("%", match["token"])
    rest = answer[match.end() :]
    if _AFTER_NUMBER.match(rest):
        return number
    word = _NEXT_WORD.match(rest)
    if word is None or word.group(1).lower() in _SCALE_WORDS | _MATH_WORDS:
        return None
    # One letter is a unit at the end ("12 m") but algebra before more ("2 x + 1").
    return number if len(word.group(1)) > 1 or word.group(2) is not None else None


def _math_span(answer: str) -> str | None:
    """The content of the ``$...$``, ``$$...$$``, ``\\(...\\)`` or ``\\[...\\]`` span that
    ``answer`` starts with, if any."""
    match = _MATH_SPAN.match(answer)
    pairs = {"$": "$", "$$": "$$", "\\(": "\\)", "\\[": "\\]"}
    if match is None or pairs[match.group(1)] != match.group(3):
        return None
    return match.group(2).strip() or None


def pointed_answer(rest: str, *, use_last_number: bool = True) -> str | None:
    """The answer that the text after a marker or answer phrase points at (not normalised).

    Within its first sentence: a leading number, trailing clause dropped; else a leading math
    span; else, for prose, its last number; else the sentence itself (a text answer such as a
    reasoning-gym word). None when there is nothing, or prose without a number and
    ``use_last_number`` (the caller's last-number fallback decides then).

    >>> [pointed_answer(t) for t in ["42, which is 6 * 7.", "$\\\\frac{1}{2}$, or 0.5", "3/4 cup"]]
    ['42', '\\\\frac{1}{2}', '3/4']
    >>> [pointed_answer(t) for t in ["that she has 5 apples left.", "nus", "not obvious"]]
    ['5', 'nus', None]
    """
    sentence = _sentence(rest)
    if not sentence:
        return None
    for pick in (_leading_number, _math_span):
        answer = pick(sentence)
        if answer is not None:
            return answer
    if _PROSE.match(sentence):
        last = _last_value(sentence)
        if last is not None:
            return _PERCENT.sub("%", last.group(0))
        if use_last_number:
            return None
    return sentence.strip("$").strip()  # an unclosed "$x + 1" of a cut-off completion


def normalize_answer(answer: str) -> str:
    """Light, safe cleanup of an extracted answer string before verification.

    Strips whitespace, surrounding ``$``, ``\\(``/``\\)``, a trailing period, replaces the
    Unicode minus, drops plain unit words after a number ("12 dollars" -> "12", but not scale
    words like "million") and thousands separators ("1,234" -> "1234", also LaTeX "1{,}234").
    Everything else is left to math-verify's own normalisation.

    >>> normalize_answer(" $1,234.$ ")
    '1234'
    """
    text = answer.strip().replace("\u2212", "-").replace("{,}", ",")
    for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if text.startswith(left) and text.endswith(right) and len(text) >= len(left + right):
            text = text[len(left) : len(text) - len(right)].strip()
    text = text.rstrip(".").strip()
    with_words = _NUMBER_THEN_WORDS.match(text)
    if with_words and not _SCALE_WORDS & set(with_words.group(2).lower().split()):
        text = with_words.group(1)
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    return text


@dataclass(frozen=True)
class FinalStatement:
    """Where a completion states its final answer (:func:`final_statement`).

    ``kind`` is ``"boxed"``, ``"marker"`` (``####``), ``"phrase"`` ("the answer is") or
    ``"last"`` (the last-number fallback); ``answer`` the extracted answer before
    :func:`normalize_answer`; ``text`` the box content, the first sentence after the marker or
    phrase, or the sentence holding the last number. ``source[start:end]`` is that box or
    sentence in the text searched: the completion for a box, else the completion without its
    Markdown emphasis.
    """

    kind: str
    answer: str
    text: str
    source: str
    start: int
    end: int


def final_statement(text: str, *, use_last_number: bool = True) -> FinalStatement | None:
    """The final answer statement of a completion (see the module docstring for the order).

    >>> final_statement("So 3 + 4 = 7.\\nThe answer is 7, or maybe 8. Done.").text
    '7, or maybe 8'
    """
    box = _last_box(text)
    if box is not None and box[2].strip():
        return FinalStatement("boxed", box[2], box[2], text, box[0], box[1])
    plain = strip_markup(text.replace("\u2212", "-").replace("{,}", ","))
    plain = _NEGATIVE_WORD.sub("-", plain)
    for kind, offset in (("marker", _marker_offset(plain)), ("phrase", _phrase_offset(plain))):
        if offset is None:
            continue
        answer = pointed_answer(plain[offset:], use_last_number=use_last_number)
        if answer:
            sentence, length = _sentence_span(plain[offset:])
            return FinalStatement(kind, answer, sentence, plain, offset, offset + length)
    last = _last_value(plain) if use_last_number else None
    if last is None:
        return None
    start = max((m.end() for m in _BOUNDARY.finditer(plain, 0, last.start())), default=0)
    after = _BOUNDARY.search(plain, last.end())
    end = after.start() if after else len(plain)
    answer = _PERCENT.sub("%", last.group(0))
    return FinalStatement("last", answer, plain[start:end].strip(), plain, start, end)


def extract_answer(text: str, *, use_last_number: bool = True) -> str | None:
    """Final answer of a completion (see the module docstring for the order), normalised.

    >>> extract_answer(r"... so the result is \\boxed{\\dfrac{3}{4}}.")
    '\\\\dfrac{3}{4}'
    >>> extract_answer("She pays 3 * 4 = 12 dollars.\\n#### 12")
    '12'
    >>> extract_answer("The answer is 1,000.")
    '1000'
    >>> extract_answer("46"), extract_answer("She ate 3 1/2 pies.")
    ('46', '3 1/2')
    >>> extract_answer("no digits here") is None
    True
    """
    statement = final_statement(text, use_last_number=use_last_number)
    return None if statement is None else normalize_answer(statement.answer)


def _last_value(text: str) -> re.Match[str] | None:
    """The last value token of ``text`` (a number with its fraction, exponent, scale word)."""
    last = None
    for last in VALUE_TOKEN.finditer(text):  # noqa: B007 (the loop finds the last match)
        pass
    return last


def _marker_offset(text: str) -> int | None:
    """Where the line after the last GSM8K ``####`` marker starts, a "Final Answer" heading
    skipped."""
    markers = list(_GSM8K_MARKER.finditer(text))
    if not markers:
        return None
    heading = _ANSWER_HEADING.match(markers[-1].group(1))
    return markers[-1].start(1) + (heading.end() if heading else 0)


def _phrase_offset(text: str) -> int | None:
    """Where the text after the last answer phrase starts."""
    phrases = list(_ANSWER_PHRASE.finditer(text))
    return phrases[-1].end() if phrases else None


def normalize_gold(answer: str) -> str:
    """Gold answer string for verification: the GSM8K ``####`` tail or the last boxed content
    if present, else the text itself; then :func:`normalize_answer`.

    >>> normalize_gold("Natalia sold 48/2 = 24 clips.\\n#### 72")
    '72'
    >>> normalize_gold(r"The sum is $\\boxed{\\frac{1}{2}}$.")
    '\\\\frac{1}{2}'
    >>> normalize_gold("1,234")
    '1234'
    """
    markers = _GSM8K_MARKER.findall(answer)
    if markers:  # an empty "####" tail is an empty (not gradable) gold
        return normalize_answer(markers[-1])
    boxed = last_boxed(answer)
    if boxed is not None and boxed.strip():
        return normalize_answer(boxed)
    return normalize_answer(answer)
