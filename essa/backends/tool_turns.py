"""Tool-integrated generation on the HF backend: :func:`generate_texts` turn by turn.

Each turn is one :func:`~essa.backends.generate.generate_texts` call over the rows still
running: rows of different candidates share its batched forwards, rows drop out as they stop
(EOS or a closed code block, :class:`~essa.backends.stops.ToolCallStop`), and the shared prompt
prefix is cached as in a plain call. Between turns the sandbox runs the closed blocks
(essa.tools.turns); a row that called comes back in the next turn with its prompt, its turns
and the tool's output block as its context. The next turn re-encodes that context in its
prefill (the shared prefix excepted) instead of keeping the row's KV cache: the cost is one
prefill per call, and every turn stays one batched forward per decode step.

Only the first turn carries the reference (its log-probs after the prompt, as without tools);
the reference draft is off (a drafted reference could run past a code block).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from essa.backends.decode import NonFiniteGuard
from essa.backends.generate import generate_texts
from essa.backends.stops import ToolCallStop, stop_token_ids
from essa.config import GenerationConfig, PythonToolConfig
from essa.tools.turns import Execute, Transcript, run_turns

_TURN_SEED_MIX = 0x9E3779B97F4A7C15 >> 1  # odd, < 2**63: a turn's row seed stays an int64


def turn_seed(row_seed: int, turn: int) -> int:
    """Row ``row_seed``'s sampling stream in ``turn`` (turn 0: the row's own, as without tools)."""
    return row_seed ^ (turn * _TURN_SEED_MIX % 2**63)


def generate_turns(
    model: Any,
    tokenizer: Any,
    token_ids: Sequence[Sequence[int]],
    gen: GenerationConfig,
    tools: PythonToolConfig,
    *,
    micro_batch_size: int,
    row_candidates: torch.Tensor | None = None,
    set_rows: Callable[[torch.Tensor], None] | None = None,
    seed: int | None = None,
    use_prefix_cache: bool = False,
    guard: NonFiniteGuard | None = None,
    progress: Callable[[int], None] | None = None,
    row_seeds: Sequence[int] | None = None,
    logprobs: list[list[float]] | None = None,
    reference_ids: Sequence[Sequence[int]] | None = None,
    reference_logprobs: list[list[float]] | None = None,
    execute: Execute | None = None,
    stopping: ToolCallStop | None = None,
) -> tuple[list[str], int, list[Transcript]]:
    """(completions, new tokens, transcripts): :func:`generate_texts`' arguments, with tool
    calls (``tools``). A completion is the whole transcript's text, tool outputs included;
    ``logprobs`` get the model's own tokens only; ``guard`` flags a row flagged in any turn;
    ``progress`` counts the first turn's rows. ``stopping``: a caller's
    :class:`ToolCallStop` for this tokenizer and ``tools`` (built here when None)."""
    n = len(token_ids)
    candidates = (
        torch.zeros(n, dtype=torch.long)
        if row_candidates is None
        else torch.as_tensor(row_candidates, dtype=torch.long).cpu()
    )
    stops = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
    stopping = stopping or ToolCallStop(tokenizer, tools)
    per_row_logprobs: list[list[list[float]]] = [[] for _ in range(n)]  # row -> turn -> token
    counted = [0]
    turn = [0]

    def one_turn(rows: list[int], contexts: list[list[int]], may_call: bool) -> list[list[int]]:
        first = turn[0] == 0
        sub_guard = None if guard is None else NonFiniteGuard(len(rows), guard.eos_token_id)
        lp: list[list[float]] | None = None if logprobs is None else []
        ids: list[list[int]] = []
        seeds = None if row_seeds is None else [turn_seed(row_seeds[r], turn[0]) for r in rows]
        _, new = generate_texts(
            model, tokenizer, [""] * len(rows), gen, micro_batch_size=micro_batch_size,
            row_candidates=candidates[rows], set_rows=set_rows,
            seed=None if seed is None else seed + turn[0], use_prefix_cache=use_prefix_cache,
            guard=sub_guard, progress=progress if first else None, token_ids=contexts,
            row_seeds=seeds, logprobs=lp,
            reference_ids=None if reference_ids is None or not first else reference_ids,
            reference_logprobs=reference_logprobs if first else None,
            stopping=stopping if may_call else None, out_ids=ids,
        )  # fmt: skip
        counted[0] += new
        if guard is not None and sub_guard is not None:
            guard.rows[torch.tensor(rows, dtype=torch.long)] |= sub_guard.rows
        if lp is not None:
            for r, row_lp, row_ids in zip(rows, lp, ids, strict=True):
                per_row_logprobs[r].append(row_lp[: len(row_ids)])  # cut below: per turn
        turn[0] += 1
        return ids

    transcripts = run_turns(token_ids, one_turn, tokenizer, tools, execute, stops)
    if logprobs is not None:
        for r, t in enumerate(transcripts):
            model_turns = [len(ids) for ids, own in t.segments if own]
            logprobs.append(
                [x for lp, k in zip(per_row_logprobs[r], model_turns, strict=True) for x in lp[:k]]
            )
    texts = [tokenizer.decode(t.ids, skip_special_tokens=True) for t in transcripts]
    return texts, counted[0], transcripts
