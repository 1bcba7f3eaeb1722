"""SFT targets with a tool call, built from a task's own items (tool-integrated reasoning).

With ``tools.python.max_tool_calls`` > 0 and ``sft_with_code``, an SFT example whose question
a solver below recognises gets the target a tool-using rollout should produce::

    {code_start}\\n{code}\\n{code_end}{output_start}{value}{output_end}{answer line}

(with the defaults: a ```` ```python ```` block, then ```` ```output ```` holding what the code
prints, then ``The answer is <answer>.``), so a small chat model learns the format in the SFT
stage. A solver reads numbers out of the question and writes the code that computes the answer
(an arithmetic expression, gcd/lcm, bit counts, letter counts); the value is computed here the
same way the code would print it, and the example keeps its text target unless that value
equals its reference answer. Questions no solver reads keep their text target: the SFT then
mixes both kinds, and the model may still call the tool on them.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import replace

from essa.config import PythonToolConfig
from essa.types import Example

# (code ending in the expression to show, its value) from a question, or None when the solver
# does not apply; the expression is printed (or shown, with show_last_expression).
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


SOLVERS: tuple[Solver, ...] = (gcd_lcm, count_bits, letter_count, arithmetic)


def solve(question: str) -> tuple[str, str] | None:
    """The first solver's (code, printed value) for ``question``, or None."""
    for solver in SOLVERS:
        found = solver(question)
        if found is not None:
            return found
    return None


def tool_target(code: str, value: str, answer_line: str, cfg: PythonToolConfig) -> str:
    """The SFT target of one tool call (see the module docstring)."""
    if not cfg.show_last_expression:  # the block must print its value itself
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
