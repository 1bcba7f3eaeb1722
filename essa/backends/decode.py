"""A decode loop that stops paying for finished rows, with the same tokens as ``generate``.

Completions vary from a few tokens to hundreds; HF ``generate`` keeps every row of a batch in
every forward until the longest one ends. :func:`decode_rows` runs the same steps (prefill,
then one token per step on a ``DynamicCache`` with the layers ``generate`` would give it, the
logits processors that ``generate`` would build from the model's generation config and ours,
argmax or multinomial), and whenever at least ``1 / COMPACT_FRACTION`` of the running rows
have ended it drops them from the batch: the token history, the attention mask, the
positions, every cache layer (``DynamicCache.batch_select_indices``, full-attention and
sliding-window layers alike) and the row -> candidate map (``set_rows`` is called with the
surviving rows' candidates). Greedy completions are token for token those of ``generate``
(tested). Sampling keeps its semantics (temperature, top-p and the model's processors), but
once rows are dropped the multinomial draws come from a smaller batch, so a seed gives
different samples than ``generate`` would.

Host syncs: which rows have ended is read back every ``check_every`` steps (1 on CPU, where a
read costs nothing; ``ACCELERATOR_CHECK_EVERY`` on GPUs, where each read drains the launch
queue); finished rows in between are fed padding as ``generate`` does. The non-finite guard
flags rows on the device and is read back at the same points.

Uses two private ``GenerationMixin`` helpers to build exactly the processors ``generate``
builds; :func:`supports_row_dropping` says when this loop applies (a cache layout that
``essa.backends.cache`` handles, full-attention and sliding-window layers as in Llama, Qwen,
SmolLM2, Gemma 2/3 and Mistral, and those helpers present); otherwise the caller uses
``generate``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from essa.backends.cache import (
    cache_argument,
    cache_windows,
    fast_cache_layout,
    model_cache,
    record_past,
    rewind,
)
from essa.backends.sampling import RowPicker
from essa.backends.stops import ToolCallStop
from essa.backends.teacher import MarginSink, token_scores

COMPACT_FRACTION = 8  # drop ended rows once they are at least 1/8 of the running batch
ACCELERATOR_CHECK_EVERY = 4  # steps between reads of the finished rows on a GPU


class NonFiniteGuard:
    """Flags generated rows whose next-token logits were ever NaN or infinite, and ends them.

    A candidate whose scaled adapter overflows produces non-finite logits: greedy argmax then
    picks an arbitrary token and sampling raises. A flagged row gets EOS as its only choice, so
    it ends at once; the caller marks its candidate failed (NaN fitness) instead of grading
    garbage. ``rows`` (N,) covers all rows of one ``generate_texts`` call. Detection stays on
    the device (:meth:`check`); flags reach ``rows`` when the decode loop reads them back.
    """

    def __init__(self, n_rows: int, eos_token_id: int) -> None:
        self.rows = torch.zeros(n_rows, dtype=torch.bool)  # (N,)
        self.eos_token_id = eos_token_id
        self._pending: tuple[int, torch.Tensor | None] = (0, None)  # generate's flags

    def check(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bad (B,), logits with bad rows reduced to EOS), without a host sync."""
        bad = ~torch.isfinite(logits).all(dim=-1)  # (B,)
        eos_only = torch.full_like(logits[:1], float("-inf"))  # (1, V)
        eos_only[0, self.eos_token_id] = 0.0
        return bad, torch.where(bad[:, None], eos_only, logits)

    def processors(self, start: int, stop: int) -> Any:
        """For ``generate``: flags rows [start, stop) of ``rows``; read back by :meth:`flush`."""
        from transformers import LogitsProcessor, LogitsProcessorList

        guard = self
        guard._pending = (start, None)

        class _Check(LogitsProcessor):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                bad, scores = guard.check(scores)
                flags = guard._pending[1]
                guard._pending = (start, bad if flags is None else flags | bad)
                return scores

        return LogitsProcessorList([_Check()])

    def flush(self) -> None:
        """Copy the flags gathered by :meth:`processors` into ``rows`` (one host sync)."""
        start, flags = self._pending
        if flags is not None:
            self.rows[start : start + len(flags)] |= flags.cpu()
        self._pending = (0, None)


def supports_row_dropping(model: Any) -> bool:
    """True when :func:`decode_rows` can run ``model`` (see the module docstring)."""
    helpers = ("_prepare_generation_config", "_prepare_special_tokens", "_get_logits_processor")
    if not all(hasattr(model, name) for name in helpers) or not fast_cache_layout(model):
        return False
    # The loop passes these by name; a wrapper whose forward takes **kwargs only (a PeftModel)
    # might drop one silently, so such models keep generate (which unwraps them itself).
    named = set(inspect.signature(model.forward).parameters)
    return {"input_ids", "attention_mask", "position_ids", "use_cache"} <= named and bool(
        named & {"cache", "past_key_values"}
    )


def decode_processors(
    model: Any, generate_kwargs: dict[str, Any], input_ids: torch.Tensor
) -> tuple[Any, Any]:
    """(generation config, logits processors) exactly as ``generate`` builds them."""
    from transformers import LogitsProcessorList

    config, _ = model._prepare_generation_config(None, **generate_kwargs)
    model._prepare_special_tokens(config, True, device=input_ids.device)
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=input_ids.shape[1],
        encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=None,
        logits_processor=LogitsProcessorList(),
        device=input_ids.device,
        model_kwargs={},
    )
    return config, processors


class _Running:
    """The still-running rows of one micro-batch; ``origin[i]`` is row i's index in the batch."""

    def __init__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, past: int, max_new: int
    ) -> None:
        positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)  # (B, T)
        self.origin = torch.arange(input_ids.shape[0])  # (b,) CPU
        self.sequences = input_ids  # (b, T + t) prompt and generated tokens
        self.mask = attention_mask  # (b, T + t)
        self.step_ids = input_ids[:, past:]  # (b, T - past) then (b, 1)
        self.step_positions = positions[:, past:]  # same shape as step_ids
        self.unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        self.flagged = torch.zeros_like(self.unfinished)  # (b,) non-finite logits seen
        self.left = torch.full_like(self.step_ids[:, 0], max_new)  # (b,) tokens it may still emit
        # A reference draft (_draft_prefill) puts `drafted` columns after the prompt, of which
        # each row emitted its first `accepted` (b,); the rest are masked holes.
        self.drafted = 0
        self.accepted = torch.zeros(input_ids.shape[0], dtype=torch.long)  # (b,) CPU

    def append(self, tokens: torch.Tensor) -> None:
        """Add one token per row (b,) and advance mask and positions."""
        self.sequences = torch.cat([self.sequences, tokens[:, None]], dim=-1)
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(tokens), 1))], dim=-1)
        self.step_positions = self.step_positions[:, -1:] + 1
        self.step_ids = tokens[:, None]
        self.left = self.left - 1

    def keep(self, kept: torch.Tensor, cache: Any) -> None:
        """Keep only rows ``kept`` (k,) CPU indices, in the batch and in the cache."""
        index = kept.to(self.sequences.device)
        names = ("sequences", "mask", "step_ids", "step_positions", "unfinished", "flagged", "left")
        for name in names:
            setattr(self, name, getattr(self, name).index_select(0, index))
        cache.batch_select_indices(index)
        self.origin = self.origin[kept]
        self.accepted = self.accepted[kept]

    def new_tokens(self, rows: torch.Tensor, width: int, max_new: int) -> list[torch.Tensor]:
        """The generated tokens of ``rows`` (k,), CPU: each row's accepted draft, then what it
        decoded, at most ``max_new`` (a row that ran out before the others was fed pads)."""
        tokens = self.sequences[:, width:].index_select(0, rows.to(self.sequences.device)).cpu()
        if not self.drafted:
            return list(tokens)
        accepted = self.accepted[rows].tolist()
        return [
            torch.cat([row[:k], row[self.drafted :]])[:max_new]
            for row, k in zip(tokens, accepted, strict=True)
        ]


@torch.no_grad()
def decode_rows(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    generate_kwargs: dict[str, Any],
    *,
    cache: Any = None,
    rows: torch.Tensor | None = None,
    set_rows: Callable[[torch.Tensor], None] | None = None,
    guard: NonFiniteGuard | None = None,
    guard_offset: int = 0,
    check_every: int | None = None,
    picker: RowPicker | None = None,
    teacher: Sequence[Sequence[int]] | None = None,
    teacher_logprobs: list[list[float]] | None = None,
    draft: bool = False,
    stopping: ToolCallStop | None = None,
) -> torch.Tensor:
    """New tokens (B, T_new) on CPU, padded after each row's stop token as ``generate`` pads.

    ``generate_kwargs`` are those ``generate`` would get (max_new_tokens, pad and eos ids,
    sampling settings); ``cache`` may hold a shared prefix (its length is skipped in the
    prefill); ``rows`` (B,) are the batch rows' candidates for ``set_rows``. Guard flags go to
    ``guard.rows[guard_offset + i]``. A ``picker`` (essa.backends.sampling.RowPicker) chooses
    the tokens instead (common-random-number sampling, log-probs); ``generate_kwargs`` must then
    be greedy, so that the processors do not warp the scores a second time.

    ``teacher`` (B lists of token ids, e.g. each row's reference answer) is teacher-forced in
    the prefill, right after the prompt: the prefill's logits then also give every teacher
    token's log-prob (appended to ``teacher_logprobs``, one list per row), and the teacher
    tokens are cropped from the cache before decoding, so the completions are unchanged. The
    reference's likelihood costs ``len(teacher)`` extra prefill tokens per row, not a second
    pass over the prompt. With ``draft`` (greedy decoding, :func:`draft_applies`), the teacher
    is also a draft (:func:`_draft_prefill`): each row keeps the teacher tokens that greedy
    decoding would have produced, so a row that writes its reference answer takes no decode
    step for it. The tokens are greedy's, computed in one forward instead of one per token
    (equal up to float rounding in the matmuls' order, as in speculative decoding).
    ``stopping`` (tool-integrated rollouts) also ends a row when its text closes a code block;
    it turns the draft off (a drafted reference could run past the block).
    """
    config, processors = decode_processors(model, generate_kwargs, input_ids)
    device, width = input_ids.device, input_ids.shape[1]
    stops = config._eos_token_tensor
    stops = torch.zeros(0, dtype=torch.long, device=device) if stops is None else stops.view(-1)
    pad = int(generate_kwargs["pad_token_id"])
    cache = model_cache(model) if cache is None else cache
    max_new = int(generate_kwargs["max_new_tokens"])
    state = _Running(input_ids, attention_mask, cache.get_seq_length(), max_new)
    every = check_every or (1 if device.type == "cpu" else ACCELERATOR_CHECK_EVERY)
    keep_one = {"logits_to_keep": 1} if _takes_logits_to_keep(model) else {}
    done: dict[int, torch.Tensor] = {}  # batch row -> its new tokens, CPU
    longest = max((len(t) for t in teacher), default=0) if teacher is not None else 0
    drafting = (
        draft
        and stopping is None
        and teacher is not None
        and draft_applies(
            model, processors, picker is None and not config.do_sample, width + longest + max_new
        )
    )
    for step in range(max_new):
        if step == 0 and drafting and teacher is not None:
            _draft_prefill(model, state, cache, teacher, pad, teacher_logprobs, guard, stops)
        elif step == 0 and teacher is not None:
            logits = _teacher_prefill(model, state, cache, teacher, pad, teacher_logprobs)
        else:
            out = model(
                input_ids=state.step_ids,
                attention_mask=state.mask,
                position_ids=state.step_positions,
                use_cache=True,
                **{cache_argument(model): cache},
                **keep_one,
            )
            logits = out.logits[:, -1].to(dtype=torch.float32)  # (b, V)
            del out
        if step or not drafting:
            if guard is not None:
                bad, logits = guard.check(logits)
                state.flagged |= bad
            scores = processors(state.sequences, logits)  # (b, V)
            if picker is not None:
                tokens = picker.pick(logits, scores, state.origin, step)
            elif config.do_sample:
                tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            else:
                tokens = torch.argmax(scores, dim=-1)  # (b,)
            tokens = torch.where(state.unfinished, tokens, pad)
            state.append(tokens)
            state.unfinished &= ~torch.isin(tokens, stops) & (state.left > 0)
            if stopping is not None:
                state.unfinished &= ~stopping.ended(state.sequences[:, width:], state.unfinished)
        if step == max_new - 1 or (step + 1) % every:
            continue
        running = state.unfinished.cpu()  # the one host sync, every `every` steps
        ended = int((~running).sum())
        if ended == len(running):
            break
        if ended >= max(1, len(running) // COMPACT_FRACTION):
            _collect(state, ~running, width, max_new, done, guard, guard_offset)
            state.keep(running.nonzero().squeeze(1), cache)
            if set_rows is not None and rows is not None:
                set_rows(rows[state.origin])
    everyone = torch.ones(len(state.origin), dtype=torch.bool)
    _collect(state, everyone, width, max_new, done, guard, guard_offset)
    return _pad_after_stop([done[i] for i in range(len(done))], stops.cpu(), pad)


def _teacher_forward(
    model: Any,
    state: _Running,
    cache: Any,
    teacher: Sequence[Sequence[int]],
    pad: int,
    out: list[list[float]] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prefill with each row's teacher tokens after its prompt, left in the cache.

    Returns (logits (b, L + 1, V) float32 of the prompt's last position and every teacher
    position, teacher ids (b, L) right-padded with ``pad``, lengths (b,)); the teacher tokens'
    log-probs go to ``out``.
    """
    device = state.step_ids.device
    n = max((len(t) for t in teacher), default=0)
    ids = torch.full((len(teacher), n), pad, dtype=torch.long)  # (b, L) right-padded
    lengths = torch.tensor([len(row) for row in teacher], dtype=torch.long)  # (b,)
    for i, row in enumerate(teacher):
        ids[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
    ids, lengths = ids.to(device), lengths.to(device)
    live = (torch.arange(n, device=device) < lengths[:, None]).long()  # (b, L)
    last = state.step_positions[:, -1:]  # (b, 1)
    extra = {"logits_to_keep": n + 1} if _takes_logits_to_keep(model) else {}
    result = model(
        input_ids=torch.cat([state.step_ids, ids], dim=-1),
        attention_mask=torch.cat([state.mask, live], dim=-1),
        # Right pads sit after every real token of their row: nothing scored attends to them.
        position_ids=torch.cat(
            [state.step_positions, last + 1 + torch.arange(n, device=device)], -1
        ),
        use_cache=True,
        **{cache_argument(model): cache},
        **extra,
    )
    logits = result.logits[:, -(n + 1) :].to(dtype=torch.float32)  # (b, L + 1, V)
    del result
    if out is not None:
        if n:
            logp = torch.log_softmax(
                logits[:, :n], dim=-1
            )  # (b, L, V): column t predicts ids[:, t]
            picked = token_scores(logp, ids, isinstance(out, MarginSink)).cpu()  # (b, L)
            del logp
            out.extend(picked[i, : len(row)].tolist() for i, row in enumerate(teacher))
        else:
            out.extend([] for _ in teacher)
    return logits, ids, lengths


def _teacher_prefill(
    model: Any,
    state: _Running,
    cache: Any,
    teacher: Sequence[Sequence[int]],
    pad: int,
    out: list[list[float]] | None,
) -> torch.Tensor:
    """The prefill with each row's teacher tokens after its prompt: the next-token logits
    (b, V) of the prompt's last position; the teacher tokens leave the cache again."""
    record_past(cache)  # sliding-window layers must still hold the prompt's columns after the crop
    logits, ids, _ = _teacher_forward(model, state, cache, teacher, pad, out)
    rewind(cache, ids.shape[1])  # decoding continues from the prompt
    return logits[:, 0]


def _draft_prefill(
    model: Any,
    state: _Running,
    cache: Any,
    teacher: Sequence[Sequence[int]],
    pad: int,
    out: list[list[float]] | None,
    guard: NonFiniteGuard | None,
    stops: torch.Tensor,
) -> None:
    """The teacher prefill read as a greedy draft: each row emits the longest prefix of its
    teacher that greedy decoding would have produced, then its own next token.

    Column t of the prefill's logits is the model's distribution after the prompt and the
    teacher's first t tokens, so while argmax agrees with the teacher token the greedy path *is*
    the teacher: row i emits teacher[:k_i] and argmax at k_i, for the price of the prefill it
    already paid for the teacher's log-probs. The teacher columns stay in the cache; those past
    k_i are masked out (holes that full attention ignores; :func:`draft_applies` keeps windowed
    layers from counting them).
    """
    logits, ids, lengths = _teacher_forward(model, state, cache, teacher, pad, out)
    b, columns, vocab = logits.shape
    n = columns - 1
    bad = torch.zeros((b, columns), dtype=torch.bool, device=logits.device)
    if guard is not None:
        flat_bad, flat = guard.check(logits.view(-1, vocab))
        bad, logits = flat_bad.view(b, columns), flat.view(b, columns, vocab)
    greedy = logits.argmax(dim=-1)  # (b, L + 1)
    del logits
    t = torch.arange(n, device=ids.device)
    follows = (greedy[:, :n] == ids) & (t < lengths[:, None]) & ~torch.isin(ids, stops)  # (b, L)
    accepted = follows.long().cumprod(dim=1).sum(dim=1)  # (b,)
    accepted = torch.minimum(accepted, state.left - 1)  # at least one token of its own
    token = greedy.gather(1, accepted[:, None]).squeeze(1)  # (b,) the first token of its own
    state.flagged |= (bad & (torch.arange(columns, device=bad.device) <= accepted[:, None])).any(1)
    kept = t < accepted[:, None]  # (b, L) accepted teacher columns
    state.sequences = torch.cat([state.sequences, ids.masked_fill(~kept, pad), token[:, None]], -1)
    state.mask = torch.cat([state.mask, kept.long(), state.mask.new_ones((b, 1))], dim=-1)
    state.step_positions = state.step_positions[:, -1:] + accepted[:, None] + 1
    state.step_ids = token[:, None]
    state.drafted, state.accepted = n, accepted.cpu()
    state.left = state.left - accepted - 1
    state.unfinished &= ~torch.isin(token, stops) & (state.left > 0)


def draft_applies(model: Any, processors: Any, greedy: bool, columns: int) -> bool:
    """True when a teacher draft gives exactly the greedy tokens: plain argmax (no picker and
    no logits processor reading the history), and no sliding window shorter than ``columns``
    (a window counts cache columns, holes included)."""
    if not greedy or len(processors):
        return False
    windows = cache_windows(model) or []
    return all(w is None or columns < w for w in windows)


def _collect(
    state: _Running,
    which: torch.Tensor,
    width: int,
    max_new: int,
    done: dict[int, torch.Tensor],
    guard: NonFiniteGuard | None,
    guard_offset: int,
) -> None:
    """Move the new tokens (and guard flags) of running rows ``which`` (b,) bool to the host."""
    index = which.nonzero().squeeze(1)
    tokens = state.new_tokens(index, width, max_new)
    for i, row in zip(state.origin[index].tolist(), tokens, strict=True):
        done[i] = row
    if guard is not None:
        flags = state.flagged.index_select(0, index.to(state.flagged.device)).cpu()
        guard.rows[guard_offset + state.origin[index]] |= flags


def stop_lengths(rows: Sequence[torch.Tensor], stops: torch.Tensor) -> list[int]:
    """Generated tokens of each row up to and including its first stop token."""
    lengths = []
    for row in rows:
        hits = torch.isin(row, stops).nonzero()
        lengths.append(int(hits[0]) + 1 if len(hits) else len(row))
    return lengths


def _pad_after_stop(rows: list[torch.Tensor], stops: torch.Tensor, pad: int) -> torch.Tensor:
    """(B, L): each row up to its first stop token, then ``pad``; L is the longest row."""
    lengths = stop_lengths(rows, stops)
    out = torch.full((len(rows), max(lengths, default=0)), pad, dtype=torch.long)
    for i, (row, length) in enumerate(zip(rows, lengths, strict=True)):
        out[i, :length] = row[:length]
    return out


def _takes_logits_to_keep(model: Any) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters
