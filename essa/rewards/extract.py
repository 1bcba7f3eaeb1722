"""Answer extraction from completions and gold normalisation (pure string code, no sympy).

Extraction order of :func:`extract_answer` (spec rewards-and-eval.md §2, the Qwen2.5-Math
``extract_answer`` fallback chain with a GSM8K step added):

1. the last brace-matched ``\\boxed{...}`` (``\\fbox{...}`` when there is no ``\\boxed``);
2. the text after the last GSM8K ``#### `` marker;
3. the text after the last "the answer is" / "final answer is" / "Answer:" phrase;
4. the last number in the text (``use_last_number``), so that a bare completion like "46" grades.
"""

from __future__ import annotations

import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_GSM8K_MARKER = re.compile(r"####[ \t]*([^\n]*)")
# "the answer is", "final answer is", "The final answer: ", DAPO's "Answer:".
_ANSWER_PHRASE = re.compile(r"answer\s*(?:is\b\s*:?|:)[ \t]*", re.IGNORECASE)
# Thousands-grouped integers first so that "1,234" is one number, then plain decimals.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_SENTENCE_END = re.compile(r"\.(?:\s|$)")
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


def _boxed_at(text: str, start: int, command: str) -> str | None:
    """Content of the box command starting at ``start``: ``\\boxed{...}`` or ``\\boxed x``."""
    j = start + len(command)
    if j < len(text) and text[j].isalpha():  # e.g. "\boxedx" is another command
        return None
    while j < len(text) and text[j] == " ":
        j += 1
    if j < len(text) and text[j] == "{":
        return _braced_content(text, j)
    if j > start + len(command):  # "\boxed 5$": up to the closing dollar or end of line
        match = re.match(r"[^$\n]+", text[j:])
        return match.group(0).strip() if match else None
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last balanced ``\\boxed{}`` (brace-matched), falling back to ``\\fbox{}``.

    Unbalanced boxes (a truncated completion) are skipped in favour of an earlier complete one.

    >>> last_boxed(r"so \\boxed{\\frac{1}{2}} and \\boxed{\\{1, 2\\}}")
    '\\\\{1, 2\\\\}'
    >>> last_boxed("no box") is None
    True
    """
    for command in _BOX_COMMANDS:
        end = len(text)
        while (start := text.rfind(command, 0, end)) >= 0:
            content = _boxed_at(text, start, command)
            if content is not None:
                return content
            end = start
    return None


def _clean_phrase_answer(rest: str) -> str:
    """Trim the text after an answer phrase to the answer itself: one line, one sentence."""
    line = rest.split("\n", 1)[0]
    end = _SENTENCE_END.search(line)
    if end is not None:
        line = line[: end.start()]
    return line.strip().strip("$").strip().rstrip(".,;:!").strip()


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


def extract_answer(text: str, *, use_last_number: bool = True) -> str | None:
    """Final answer of a completion (see the module docstring for the order), normalised.

    >>> extract_answer(r"... so the result is \\boxed{\\dfrac{3}{4}}.")
    '\\\\dfrac{3}{4}'
    >>> extract_answer("She pays 3 * 4 = 12 dollars.\\n#### 12")
    '12'
    >>> extract_answer("The answer is 1,000.")
    '1000'
    >>> extract_answer("46")
    '46'
    >>> extract_answer("no digits here") is None
    True
    """
    boxed = last_boxed(text)
    if boxed is not None and boxed.strip():
        return normalize_answer(boxed)
    markers = _GSM8K_MARKER.findall(text)
    if markers and markers[-1].strip():
        return normalize_answer(markers[-1])
    phrases = list(_ANSWER_PHRASE.finditer(text))
    if phrases:
        answer = _clean_phrase_answer(text[phrases[-1].end() :])
        if answer:
            return normalize_answer(answer)
    if use_last_number:
        numbers = _NUMBER.findall(text.replace("\u2212", "-"))
        if numbers:
            return normalize_answer(numbers[-1])
    return None


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
