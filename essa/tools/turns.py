"""Tool-integrated rollouts: the turn format and the loop that runs code between turns.

A rollout is a sequence of turns. The model writes until a code block closes (``code_start``
... ``code_end``, ToRL's ```` ```python ```` ... ```` ``` ```` by default) or until it stops;
a closed block's code runs in the sandbox (essa.tools.sandbox) and its output is appended
inside an output block (``output_start`` ... ``output_end``), then the model writes the next
turn, up to ``max_tool_calls`` blocks per row. The last allowed turn does not stop at a block.

:func:`run_turns` drives the turns over token ids. It needs one backend callable,
``generate_turn(rows, contexts, stop_at_code)``, that continues every context (prompt and the
row's transcript so far) by one turn and returns each row's new token ids; a backend batches
the rows of a turn together (one forward per decode step for all of them) and stops a row when
its block closes (essa.backends.stops.ToolCallStop). Rows that made a call come back in the
next turn with their transcript as part of their context; the others are done.

Imports no model code and no numeric library, like the sandbox.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from essa.config import PythonToolConfig
from essa.tools.sandbox import ToolResult, run_python_batch

TurnEnd = Literal["code", "stop", "length"]  # a closed code block, a stop token, the length cap


@dataclass
class Transcript:
    """One row's rollout after its prompt: the model's turns and the tool outputs between."""

    segments: list[tuple[list[int], bool]] = field(default_factory=list)  # (ids, the model's)
    ends: list[TurnEnd] = field(default_factory=list)  # how each model turn ended
    turns: list[str] = field(default_factory=list)  # each model turn's text
    results: list[ToolResult] = field(default_factory=list)  # one per call, in order

    @property
    def ids(self) -> list[int]:
        """Every token after the prompt, the tool outputs' included."""
        return [t for ids, _ in self.segments for t in ids]

    @property
    def calls(self) -> int:
        return len(self.results)

    @property
    def errors(self) -> int:
        return sum(r.error is not None for r in self.results)


def block_end(text: str, cfg: PythonToolConfig) -> int | None:
    """Character offset just past the first code block that closes in ``text``, else None.

    >>> from essa.config import PythonToolConfig
    >>> block_end("so ```python\\nprint(1)\\n``` and on", PythonToolConfig())
    25
    >>> block_end("```python\\nprint(1)\\n", PythonToolConfig()) is None
    True
    """
    start = text.find(cfg.code_start)
    if start < 0:
        return None
    close = text.find(cfg.code_end, start + len(cfg.code_start))
    return None if close < 0 else close + len(cfg.code_end)


def closing_tokens(tokenizer: Any, char: str) -> list[bool]:
    """Per token id: may its text hold ``char`` (the last character of ``code_end``)? See
    :func:`may_hold`; a false positive costs one decode."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return [may_hold(piece, char) for piece in pieces]


def may_hold(piece: str | None, char: str) -> bool:
    """Whether a vocabulary piece may hold ``char`` once decoded. Pieces spell whitespace their
    own way: byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) a newline ``Ċ`` and a space ``Ġ``,
    SentencePiece a space ``▁`` (which decoding a lone piece drops) and a byte it has no piece
    for ``<0x0A>``.

    >>> may_hold("Ċ", "\\n"), may_hold("▁The", " "), may_hold("<0x0A>", "\\n"), may_hold("ab", " ")
    (True, True, True, False)
    """
    if piece is None:
        return False
    last_byte = char.encode()[-1]
    spellings = {char, _BYTE_LEVEL[last_byte]} | ({"\u2581"} if char == " " else set())
    return piece == f"<0x{last_byte:02X}>" or any(c in piece for c in spellings)


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte-to-character table: printable bytes stand for themselves, the others
    (space, newline, ...) for the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = iter(range(0x100, 0x200))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


_BYTE_LEVEL = _byte_level_alphabet()


def block_code(text: str, cfg: PythonToolConfig) -> str | None:
    """The code of the first closed block in ``text`` (None when no block closes)."""
    end = block_end(text, cfg)
    if end is None:
        return None
    start = text.find(cfg.code_start) + len(cfg.code_start)
    return text[start : end - len(cfg.code_end)]


def with_echo(code: str) -> str:
    """``code`` with its last statement printed when it is an expression (as a notebook shows
    it), so that ``x = 3 * 4`` then ``x`` shows ``12``; unparsable code is returned as is and
    fails in the sandbox with its own error.

    >>> print(with_echo("a = 2\\na * 21"))
    a = 2
    __value = a * 21
    if __value is not None:
        print(repr(__value))
    """
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return code
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    last = tree.body[-1]
    if isinstance(last.value, ast.Call) and getattr(last.value.func, "id", None) == "print":
        return code
    # ast's lines split at \n, \r\n and \r only (str.splitlines also splits at \f, \x1c,
    # ...), and its columns count UTF-8 bytes, not characters.
    lines = re.split(r"(?<=\r\n)|(?<=\n)|(?<=\r)(?!\n)", code)
    line = lines[last.lineno - 1].encode()[: last.col_offset].decode()
    head = "".join(lines[: last.lineno - 1]) + line
    expression = ast.get_source_segment(code, last.value) or ""
    prefix = head.rstrip() + "\n" if head.strip() else ""
    return f"{prefix}__value = {expression}\nif __value is not None:\n    print(repr(__value))"


def output_text(result: ToolResult) -> str:
    """What the model sees of a run: its stdout, or its error line when it failed.

    >>> from essa.tools.sandbox import ToolResult
    >>> output_text(ToolResult("7\\n", "", 0, False, False, None))
    '7'
    >>> output_text(ToolResult("", "", 1, False, False, "exit status 1: NameError: x"))
    'exit status 1: NameError: x'
    """
    if result.error is None:
        return result.stdout.rstrip("\n")
    shown = result.stdout.rstrip("\n")
    return f"{shown}\n{result.error}" if shown else result.error


def output_block(result: ToolResult, cfg: PythonToolConfig) -> str:
    return f"{cfg.output_start}{output_text(result)}{cfg.output_end}"


GenerateTurn = Callable[[list[int], list[list[int]], bool], list[list[int]]]
Execute = Callable[[Sequence[str]], list[ToolResult]]


def run_turns(
    prompts: Sequence[Sequence[int]],
    generate_turn: GenerateTurn,
    tokenizer: Any,
    cfg: PythonToolConfig,
    execute: Execute | None = None,
    stop_ids: Sequence[int] = (),
) -> list[Transcript]:
    """Run every row's turns; one :class:`Transcript` per prompt (token ids, no specials).

    ``generate_turn(rows, contexts, stop_at_code)`` continues ``contexts`` (the rows' prompts
    and transcripts, for the row indices ``rows``) by one turn each; a row's new ids may run
    past the block's end (the stop is seen a step late, or pads follow): the turn is cut where
    the block closes. ``stop_ids`` are the tokens that end a completion: a turn with neither
    a stop token nor a closed block ran into the length cap.
    """
    execute = execute or (lambda codes: run_python_batch(codes, cfg))
    transcripts = [Transcript() for _ in prompts]
    contexts = [list(p) for p in prompts]
    active = list(range(len(prompts)))
    stops = set(stop_ids)
    for turn in range(cfg.max_tool_calls + 1):
        if not active:
            break
        may_call = turn < cfg.max_tool_calls
        new = generate_turn(active, [contexts[i] for i in active], may_call)
        calling: list[int] = []
        codes: list[str] = []
        for row, ids in zip(active, new, strict=True):
            ids, text, end = _cut_turn(list(ids), tokenizer, cfg, stops, may_call)
            transcripts[row].segments.append((ids, True))
            transcripts[row].ends.append(end)
            transcripts[row].turns.append(text)
            contexts[row].extend(ids)
            if end == "code":
                calling.append(row)
                code = block_code(text, cfg) or ""
                codes.append(with_echo(code) if cfg.show_last_expression else code)
        results = _run_once_each(codes, execute)
        for row, result in zip(calling, results, strict=True):
            block = tokenizer(output_block(result, cfg), add_special_tokens=False)["input_ids"]
            transcripts[row].segments.append((list(block), False))
            transcripts[row].results.append(result)
            contexts[row].extend(block)
        active = calling
    return transcripts


def _run_once_each(codes: list[str], execute: Execute) -> list[ToolResult]:
    """``execute`` on each distinct snippet once, its result shared by every row that wrote it:
    a population's candidates mostly write the same code for a prompt (16 rows, one run).
    Code that reads the clock or draws random numbers would differ between runs; rows that
    share it share one run."""
    unique = list(dict.fromkeys(codes))
    results = dict(zip(unique, execute(unique) if unique else [], strict=True))
    return [results[code] for code in codes]


def _cut_turn(
    ids: list[int],
    tokenizer: Any,
    cfg: PythonToolConfig,
    stops: set[int],
    may_call: bool,
) -> tuple[list[int], str, TurnEnd]:
    """(the turn's ids, its text, how it ended): up to its first stop token (kept), or up to
    the token that closes a code block when the row may call."""
    for k, token in enumerate(ids):
        if token in stops:
            ids = ids[: k + 1]
            return ids, tokenizer.decode(ids, skip_special_tokens=True), "stop"
        if may_call and _may_close(tokenizer, token, cfg.code_end[-1]):
            text = tokenizer.decode(ids[: k + 1], skip_special_tokens=True)
            if block_end(text, cfg) is not None:
                return ids[: k + 1], text, "code"
    return ids, tokenizer.decode(ids, skip_special_tokens=True), "length"


def _may_close(tokenizer: Any, token: int, char: str) -> bool:
    return char in tokenizer.decode([token]) or may_hold(
        tokenizer.convert_ids_to_tokens(token), char
    )


def is_void(transcript: Transcript, answer: str | None) -> bool:
    """SimpleTIR's void turn: a turn that ends with neither a closed code block nor an answer.
    Only a row's last turn can end without a block, so that is a last turn cut by the length
    cap, or one that stopped with no ``answer`` (the reward's extractor on the last turn)."""
    if not transcript.ends:
        return False
    return "length" in transcript.ends or (transcript.ends[-1] == "stop" and answer is None)


@dataclass
class ToolTally:
    """Tool use over a set of rollouts, for the metrics: rows, calls, errors, rows by their
    number of calls (0, 1, 2 or more), rows with a void turn, and rows whose final turn states
    an answer that a tool printed."""

    rows: int = 0
    calls: int = 0
    errors: int = 0
    by_calls: list[int] = field(default_factory=lambda: [0, 0, 0])  # rows with 0, 1, 2+ calls
    void: int = 0
    output_used: int = 0

    def add(self, transcripts: Sequence[Transcript], answers: Sequence[str | None]) -> None:
        """``answers[i]``: the answer extracted from row i's final turn (None: none)."""
        for t, answer in zip(transcripts, answers, strict=True):
            self.rows += 1
            self.calls += t.calls
            self.errors += t.errors
            self.by_calls[min(t.calls, 2)] += 1
            self.void += is_void(t, answer)
            self.output_used += answer is not None and _printed(answer, t.results)

    def metrics(self) -> dict[str, float]:
        rows = max(self.rows, 1)
        return {
            "tool_calls_per_row": self.calls / rows,
            "tool_error_rate": self.errors / max(self.calls, 1),
            "tool_rows": (self.rows - self.by_calls[0]) / rows,
            "tool_rows_0_calls": self.by_calls[0] / rows,
            "tool_rows_1_call": self.by_calls[1] / rows,
            "tool_rows_2plus_calls": self.by_calls[2] / rows,
            "tool_void_rows": self.void / rows,
            "tool_output_used": self.output_used / rows,
        }


def _printed(answer: str, results: Sequence[ToolResult]) -> bool:
    """True when a successful run printed ``answer`` as one of its output's words or lines."""
    for r in results:
        if r.error is None:
            words = r.stdout.replace("'", " ").replace('"', " ").split()
            if answer in words or answer in r.stdout.splitlines():
                return True
    return False
