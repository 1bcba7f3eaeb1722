"""SFT targets with a tool call, built from a task's own items (tool-integrated reasoning).

With ``tools.python.max_tool_calls`` > 0 and ``sft_with_code``, an SFT example whose question
a solver below recognises gets the target a tool-using rollout should produce::

    {code_start}\\n{code}\\n{code_end}{output_start}{value}{output_end}{answer line}

(with the defaults: a ```` ```python ```` block, then ```` ```output ```` holding what the code
prints, then ``The answer is <answer>.``), so a small chat model learns the format in the SFT
stage. A solver reads numbers out of the question and writes the code that computes the answer
(an arithmetic expression, gcd/lcm, bit counts, letter counts, the legs of the animals listed,
``datetime``/``calendar`` calls on dates written out, the words to sort, a number's digits in
another base); the value is computed here the same way
the code would print it, and the example keeps its text target unless that value
equals its reference answer. Questions no solver reads keep their text target: the SFT then
mixes both kinds, and the model may still call the tool on them.
"""

from __future__ import annotations

import ast
import calendar
import contextlib
import io
import math
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import replace

from essa.config import PythonToolConfig
from essa.types import Example

# (code ending in the expression to show, or in a print call, and its value) from a question,
# or None when the solver does not apply; the expression is printed (or shown, with
# show_last_expression).
Solver = Callable[[str], tuple[str, str] | None]

_EXPRESSION = re.compile(r"(?<![\w.])(-?\d[\d\s+\-*/().]*[\d)])\s*(?:=|\?|\.|$)")
_OPERATORS: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
}


def _value(node: ast.AST) -> int:
    """An integer expression of + - * and parentheses, evaluated; anything else raises."""
    if isinstance(node, ast.Expression):
        return _value(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return int(_OPERATORS[type(node.op)](_value(node.left), _value(node.right)))
    raise ValueError("not an integer + - * expression")


def arithmetic(question: str) -> tuple[str, str] | None:
    """The last integer expression with an operator (``4 - 1 - 7 =``, ``18271 * 43432.``,
    ``12+30=``) as code.

    >>> arithmetic("State the final answer: 4 - 1 - 7 =")
    ('4 - 1 - 7', '-4')
    """
    for match in reversed(list(_EXPRESSION.finditer(question))):
        text = " ".join(match.group(1).split())
        if not any(op in text.lstrip("-") for op in "+-*"):
            continue
        try:
            return text, str(_value(ast.parse(text, mode="eval")))
        except (SyntaxError, ValueError, RecursionError):
            continue
    return None


def _numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


def gcd_lcm(question: str) -> tuple[str, str] | None:
    """``math.gcd``/``math.lcm`` of the numbers after "GCD"/"LCM" (or the words spelled out)."""
    lower = question.lower()
    for name, words in (
        ("gcd", ("gcd", "greatest common divisor")),
        ("lcm", ("lcm", "least common multiple")),
    ):
        if any(w in lower for w in words):
            numbers = _numbers(question.split(":", 1)[-1])
            if len(numbers) >= 2:
                args = ", ".join(map(str, numbers))
                value = getattr(math, name)(*numbers)
                return f"import math\nmath.{name}({args})", str(value)
    return None


def count_bits(question: str) -> tuple[str, str] | None:
    """``bin(n).count("1")`` for "how many 1 bits ... the number n"."""
    if "1 bits" not in question or "binary" not in question:
        return None
    numbers = _numbers(question.split("number", 1)[-1])
    if not numbers:
        return None
    return f'bin({numbers[0]}).count("1")', str(bin(numbers[0]).count("1"))


def letter_count(question: str) -> tuple[str, str] | None:
    """``text.lower().count(letter)`` for 'How many times does the letter "x" appear in the
    text: "..."'."""
    match = re.search(r'letter "(\w)" appear in the text: "([^"]*)"', question)
    if match is None:
        return None
    letter, text = match.group(1).lower(), match.group(2)
    return f"{text!r}.lower().count({letter!r})", str(text.lower().count(letter))


# Legs per animal, as a child learns them (insects 6, spiders 8, crabs 10, woodlice 14).
LEGS = {
    **dict.fromkeys(("snake", "sea slug", "jellyfish", "flatworm", "leech"), 0),
    **dict.fromkeys(("chicken", "bird", "human", "duck"), 2),
    **dict.fromkeys(
        ("dog", "cat", "cow", "horse", "lion", "elephant", "giraffe", "tiger", "deer", "sheep"), 4
    ),
    "starfish": 5,
    **dict.fromkeys(
        (
            "insect",
            "ant",
            "butterfly",
            "beetle",
            "bee",
            "wasp",
            "grasshopper",
            "cricket",
            "cockroach",
            "praying mantis",
            "firefly",
        ),
        6,
    ),  # fmt: skip
    **dict.fromkeys(("spider", "scorpion"), 8),
    **dict.fromkeys(("crab", "lobster", "shrimp"), 10),
    "woodlouse": 14,
}


def leg_count(question: str) -> tuple[str, str] | None:
    """Count times legs, summed, for "how many legs ... if you have 5 spiders, 1 cow?": the
    model must know each animal's legs and read the counts out of the sentence.

    >>> leg_count("how many legs are there in total if you have 5 spiders, 1 cow?")
    ('5 * 8 + 1 * 4', '44')
    """
    match = re.search(r"how many legs .* if you have (.+)\?", question)
    if match is None:
        return None
    terms: list[tuple[int, int]] = []
    for item in match.group(1).split(", "):
        count, _, name = item.partition(" ")
        name = name if name in LEGS else name.removesuffix("s")  # "5 spiders", "2 mantiss"
        if not count.isdigit() or name not in LEGS:
            return None
        terms.append((int(count), LEGS[name]))
    code = " + ".join(f"{count} * {legs}" for count, legs in terms)
    return code, str(sum(count * legs for count, legs in terms))


_MONTHS = tuple(calendar.month_name)[1:]  # January ... December
_DATE = re.compile(
    rf"({'|'.join(_MONTHS)}) (\d{{1,2}})(?:st)?\b(?:, (\d{{4}}))?|(\d\d)/(\d\d)/(\d{{4}})"
)
_WEEKDAY = re.compile(r"(Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday)")
_ORDINALS = {"first": 0, "second": 1, "third": 2, "fourth": 3, "last": -1}
# A question that names no year ("In a year where Tuesday is January 1st"): a common year, as
# reasoning-gym's calendar_arithmetic takes.
_COMMON_YEAR = 2022


def _dates(question: str) -> list[tuple[int, int, int]]:
    """The (year, month, day) dates in ``question`` in order ("May 11, 2022", "05/04/2022",
    "January 1st"); a date without its year takes the next date's year (else a common year),
    and an end date before its start date is in the next year."""
    found: list[list[int | None]] = []
    for m in _DATE.finditer(question):
        if m.group(1):
            found.append([int(m.group(3)) if m.group(3) else None, _MONTHS.index(m.group(1)) + 1,
                          int(m.group(2))])  # fmt: skip
        else:
            found.append([int(m.group(6)), int(m.group(4)), int(m.group(5))])
    year = _COMMON_YEAR
    for date in reversed(found):
        year = date[0] = date[0] or year
    dates = [(int(y or 0), int(m or 0), int(d or 0)) for y, m, d in found]
    if len(dates) == 2 and dates[1][1:] < dates[0][1:] and dates[1][0] == dates[0][0]:
        dates[1] = (dates[1][0] + 1, *dates[1][1:])
    return dates


def calendar_question(question: str) -> tuple[str, str] | None:
    """Code for reasoning-gym's calendar_arithmetic questions (leap years, the weekday of a
    date or of a date some days away, a weekday's count between two dates, the n-th weekday of
    a month): the model must turn the dates written in words into ``datetime.date`` arguments.

    >>> calendar_question("What day of the week was October 28, 2022?")[1]
    'Friday'
    """
    leap = re.search(r"(\d{4}) (?:is )?a leap year", question)
    if leap:
        year = int(leap.group(1))
        code = f'import calendar\nprint("Yes" if calendar.isleap({year}) else "No")'
        return code, "Yes" if calendar.isleap(year) else "No"
    dated = _calendar_code(question, _dates(question))
    if dated is None:
        return None
    return dated, _run_print(dated)


def _calendar_code(question: str, dates: list[tuple[int, int, int]]) -> str | None:
    """The code of one calendar question kind, or None."""
    date = "datetime.date({}, {}, {})".format
    ordinal = re.search(rf"\b({'|'.join(_ORDINALS)}) {_WEEKDAY.pattern}", question)
    month = re.search(rf"({'|'.join(_MONTHS)}) (\d{{4}})", question)
    if ordinal and month and "ordinal does not exist" in question:
        return _nth_weekday(ordinal.group(1), ordinal.group(2), month.group(1), month.group(2))
    first = re.search(rf"{_WEEKDAY.pattern} is January 1st|January 1 fell on a {_WEEKDAY.pattern}"
                      rf"|first day of the year was a {_WEEKDAY.pattern}", question)  # fmt: skip
    if first and dates:
        name, (year, _, _) = next(g for g in first.groups() if g), dates[-1]
        return (f"import datetime\ndays = ({date(*dates[-1])} - datetime.date({year}, 1, 1)).days"
                f'\nnames = {list(calendar.day_name)}\nprint(names[(names.index("{name}") + days)'
                " % 7])")  # fmt: skip
    counted = re.search(rf"many {_WEEKDAY.pattern}s|occurrences of {_WEEKDAY.pattern}"
                        rf"|times does {_WEEKDAY.pattern} occur", question)  # fmt: skip
    if len(dates) == 2 and re.search(r"business days|weekdays \(excluding", question):
        test = ".weekday() < 5"
    elif len(dates) == 2 and counted:
        test = f'.strftime("%A") == "{next(g for g in counted.groups() if g)}"'
    else:
        test = None
    if test is not None:
        return (f"import datetime\nstart, end = {date(*dates[0])}, {date(*dates[1])}\n"
                f"print(sum((start + datetime.timedelta(days=i)){test}\n"
                f"          for i in range((end - start).days + 1)))")  # fmt: skip
    offset = re.search(r"in (\d+) days|(\d+)-day jump|forward (\d+) days|(\d+) days (?:ago|before)"
                       r"|backward (\d+) days", question)  # fmt: skip
    if len(dates) == 1 and offset:
        days = int(next(g for g in offset.groups() if g))
        days = -days if re.search(r"ago|before|backward", offset.group(0)) else days
        return (f"import datetime\nprint(({date(*dates[0])} + datetime.timedelta(days={days}))"
                f'.strftime("%A"))')  # fmt: skip
    if len(dates) == 1 and re.search(r"day of the week|weekday", question):
        return f'import datetime\nprint({date(*dates[0])}.strftime("%A"))'
    return None


def _nth_weekday(ordinal: str, weekday: str, month_name: str, year: str) -> str:
    """Code for the day of the month of the ``ordinal`` ``weekday`` (-1 when there is none)."""
    month, index = _MONTHS.index(month_name) + 1, _ORDINALS[ordinal]
    pick = "days[-1]" if index < 0 else f"days[{index}] if len(days) > {index} else -1"
    return (f"import calendar\ndays = [d for d in range(1, calendar.monthrange({year}, {month})[1]"
            f" + 1)\n        if calendar.day_name[calendar.weekday({year}, {month}, d)] =="
            f' "{weekday}"]\nprint({pick})')  # fmt: skip


_SORT_WORDS = re.compile(
    r"sort these words in (ascending|descending) order .*? comma-separated list: (.+?)\s*$", re.S
)


def word_sort(question: str) -> tuple[str, str] | None:
    """``print(", ".join(sorted([...])))`` for "sort these words in ascending order ...: w1, w2": the
    model must copy every word into the list exactly (case, accents) and pick the order.

    >>> code, value = word_sort("Now, sort these words in descending order (using ASCII/Unicode "
    ...                         "ordering) and return them as a comma-separated list: Only, federal")
    >>> print(code, "->", value)
    print(", ".join(sorted(['Only', 'federal'], reverse=True))) -> federal, Only
    """
    match = _SORT_WORDS.search(question)
    if match is None:
        return None
    order, words = match.group(1), match.group(2).split(", ")
    reverse = order == "descending"
    # printed: an echoed last expression would show the string's repr, quotes and all
    code = f'print(", ".join(sorted({words!r}, reverse={reverse})))'
    return code, ", ".join(sorted(words, reverse=reverse))


_BASE_QUESTION = re.compile(
    r"convert the (binary|hexadecimal|base-\d+) number ([0-9a-z]+) to (binary|hexadecimal|base-\d+)"
)
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def _base(name: str) -> int:
    return {"binary": 2, "hexadecimal": 16}.get(name) or int(name.removeprefix("base-"))


def base_convert(question: str) -> tuple[str, str] | None:
    """``int(digits, b1)`` written out digit by digit in base b2, for "convert the base-b1 number
    D to base-b2" (reasoning-gym's base_conversion; binary and hexadecimal by name): the model
    must copy the number and both bases into a fixed loop.

    >>> code, value = base_convert("Now, convert the base-15 number 453 to binary\\n")
    >>> print(code)
    n, b, s = int("453", 15), 2, ""
    while n: n, s = n // b, "0123456789abcdefghijklmnopqrstuvwxyz"[n % b] + s
    print(s or "0")
    >>> value
    '1111010010'
    """
    match = _BASE_QUESTION.search(question)
    if match is None:
        return None
    source, digits, target = _base(match.group(1)), match.group(2), _base(match.group(3))
    if not (2 <= source <= 36 and 2 <= target <= 36):
        return None
    with contextlib.suppress(ValueError):  # digits the source base does not have: no target
        int(digits, source)
        code = (
            f'n, b, s = int("{digits}", {source}), {target}, ""\n'
            f'while n: n, s = n // b, "{_DIGITS}"[n % b] + s\n'
            'print(s or "0")'
        )
        return code, _run_print(code)
    return None


def _run_print(code: str) -> str:
    """What ``code`` (a solver's own, standard library only) prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})  # the solver's own code, never the model's
    return out.getvalue().strip()


SOLVERS: tuple[Solver, ...] = (
    gcd_lcm,
    count_bits,
    letter_count,
    leg_count,
    word_sort,
    calendar_question,
    base_convert,
    arithmetic,
)


def solve(question: str) -> tuple[str, str] | None:
    """The first solver's (code, printed value) for ``question``, or None."""
    for solver in SOLVERS:
        found = solver(question)
        if found is not None:
            return found
    return None


def _prints(code: str) -> bool:
    """Whether the code's last statement is a ``print(...)`` call (the calendar solver's)."""
    last = ast.parse(code).body[-1]
    return (
        isinstance(last, ast.Expr)
        and isinstance(last.value, ast.Call)
        and getattr(last.value.func, "id", None) == "print"
    )


def tool_target(code: str, value: str, answer_line: str, cfg: PythonToolConfig) -> str:
    """The SFT target of one tool call (see the module docstring)."""
    if not cfg.show_last_expression and not _prints(code):  # the block must print its value
        *head, last = code.split("\n")
        code = "\n".join([*head, f"print({last})"])
    return f"{cfg.code_start}{code}{cfg.code_end}{cfg.output_start}{value}{cfg.output_end}{answer_line}"


def with_tool_targets(
    examples: Sequence[Example], cfg: PythonToolConfig, answer_format: str
) -> tuple[list[Example], int]:
    """(the examples with tool targets where a solver reads the question and prints the
    reference answer, how many got one). ``answer_format`` has one ``{answer}`` field."""
    out: list[Example] = []
    made = 0
    for ex in examples:
        found = solve(ex.prompt)
        if found is None or ex.answer is None or found[1] != ex.answer.strip():
            out.append(ex)
            continue
        code, value = found
        line = answer_format.format(answer=ex.answer.strip())
        out.append(replace(ex, solution=tool_target(code, value, line, cfg)))
        made += 1
    return out, made


def tool_references(examples: Sequence[Example], cfg: PythonToolConfig) -> list[str | None]:
    """Per example, the reference a tool-using rollout is scored against (ESSA's
    ``reward.reference_weight`` tie-breaker): its code-call target where a solver reads the
    question, else its answer (what the tie-breaker takes without tools)."""
    made, _ = with_tool_targets(examples, cfg, cfg.answer_format)
    return [
        m.target if m.solution != ex.solution else ex.answer
        for m, ex in zip(made, examples, strict=True)
    ]
