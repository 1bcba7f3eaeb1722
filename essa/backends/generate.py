"""Batched generation with Hugging Face transformers: many rows (prompts x candidates) per
forward, a shared prompt prefix encoded once, rows dropped as they stop (essa.backends.decode),
the reference's teacher-forced log-probs from the same prefill (essa.backends.teacher).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from essa.backends.cache import (
    cache_argument,
    fast_cache_layout,
    has_sliding_window,
    place_prefix,
    unwindowed_cache,
)
from essa.backends.decode import (
    NonFiniteGuard,
    decode_rows,
    stop_lengths,
    supports_row_dropping,
)
from essa.backends.models import model_device
from essa.backends.sampling import RowPicker
from essa.backends.stops import ToolCallStop, stop_token_ids
from essa.backends.teacher import MarginSink
from essa.config import GenerationConfig

log = logging.getLogger(__name__)

# A shared prefix shorter than this saves little next to its extra forward and cache copies.
MIN_PREFIX_TOKENS = 8


@torch.no_grad()
def generate_texts(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    gen: GenerationConfig,
    *,
    micro_batch_size: int,
    row_candidates: torch.Tensor | None = None,
    set_rows: Callable[[torch.Tensor], None] | None = None,
    seed: int | None = None,
    use_prefix_cache: bool = False,
    guard: NonFiniteGuard | None = None,
    progress: Callable[[int], None] | None = None,
    token_ids: Sequence[Sequence[int]] | None = None,
    row_seeds: Sequence[int] | None = None,
    logprobs: list[list[float]] | None = None,
    reference_ids: Sequence[Sequence[int]] | None = None,
    reference_logprobs: list[list[float]] | None = None,
    reference_draft: bool = False,
    stopping: ToolCallStop | None = None,
    out_ids: list[list[int]] | None = None,
) -> tuple[list[str], int]:
    """Generate one completion per prompt, in micro-batches of rows.

    ``row_candidates`` (N,) names the candidate each prompt row is generated under (default: all
    rows one candidate, the model as is); ``set_rows(candidates)`` runs before every forward batch
    with the candidate of each of its rows, so a population wrapper can route them.
    ``token_ids`` are the prompts already tokenised (no special tokens added), so that a caller
    generating on the same prompts again does not tokenise them again.

    Decoding stops on the tokenizer's EOS and the model's own stop ids
    (``essa.backends.stops``) and, where the model allows it, drops rows from the batch as they
    end (``essa.backends.decode``); the completions are those of ``generate``.
    With ``use_prefix_cache``, the longest token prefix shared by all prompts (a system prompt, a
    chat header) is run once per candidate and its KV cache copied to that candidate's rows
    instead of being recomputed for every row; the completions are the same. It applies when the
    prefix has at least ``MIN_PREFIX_TOKENS`` tokens and the model's cache is one that
    ``essa.backends.cache`` handles (full-attention and sliding-window layers); otherwise every
    row is encoded whole.
    With ``guard``, rows whose logits turn non-finite are flagged in ``guard.rows`` and stopped.
    ``progress(rows)`` is called after each micro-batch. Returns (completions, new_tokens).

    ``row_seeds`` (N,) make sampling use common random numbers (essa.backends.sampling): row i
    draws from its own stream ``row_seeds[i]``, so rows with equal seeds and equal models draw
    equal samples whatever their position or batch. With ``logprobs`` (an empty list), the
    generated tokens' log-probs are appended to it, one list per row (stop token included).
    With ``reference_ids`` (N,) lists of token ids, e.g. each row's reference answer, and
    ``reference_logprobs`` (an empty list), the teacher-forced log-probs of those tokens after
    the row's prompt are appended to it, one list per row: in the decode loop's own prefill
    (``essa.backends.decode``), or a separate forward where that loop does not apply. With
    ``reference_draft`` that prefill is also a greedy draft (``decode_rows``' ``draft``).
    ``stopping`` also ends a row whose text closes a code block (tool-integrated rollouts,
    essa.backends.tool_turns); with ``out_ids`` (an empty list) each row's new token ids, up to
    its stop token or the end of the micro-batch's longest row, are appended to it.
    """
    if not prompts:
        return [], 0
    device = model_device(model)
    if row_candidates is None:
        row_candidates = torch.zeros(len(prompts), dtype=torch.long)
    row_candidates = torch.as_tensor(row_candidates, dtype=torch.long).cpu()  # (N,)
    sampling = gen.temperature > 0
    if seed is not None and sampling and row_seeds is None:
        torch.manual_seed(seed)  # sampling draws from the global torch RNG, as in HF generate
    if sampling and row_seeds is None and logprobs is not None:
        # Recording log-probs takes the picker, which samples from per-row streams only: give
        # the rows streams drawn from that same global RNG (never a greedy picker that would
        # silently turn sampling into argmax).
        row_seeds = torch.randint(-(2**63), 2**63 - 1, (len(prompts),)).tolist()
    crn = row_seeds is not None and sampling
    encoded = (
        list(token_ids)
        if token_ids is not None
        else tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    )
    stops = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
    # A picker samples or records log-probs itself: the processors must then stay greedy.
    picking = crn or logprobs is not None
    assert crn or not (picking and sampling), "a greedy picker would not sample"
    kwargs = _generate_kwargs(_greedy(gen) if crn else gen, tokenizer, stops)
    seeds = None if row_seeds is None else torch.as_tensor(list(row_seeds), dtype=torch.long)
    prefix_len = shared_prefix_length(encoded) if use_prefix_cache else 0
    prefix: PrefixStates | None = None
    if caches_prefix(model, prefix_len):
        prefix = prefix_states(
            model, encoded[0][:prefix_len], row_candidates, micro_batch_size, set_rows
        )
    else:
        prefix_len = 0
    # A sliding window counts columns: there the rows keep their whole-row layout (pad_rows).
    gap_columns = 0 if has_sliding_window(model) else prefix_len
    drop_rows = supports_row_dropping(model)
    completions: list[str] = []
    new_tokens = 0
    for start in range(0, len(prompts), micro_batch_size):
        stop = min(start + micro_batch_size, len(prompts))
        rows = row_candidates[start:stop]  # (B,)
        if set_rows is not None:
            set_rows(rows)
        input_ids, attention_mask = pad_rows(
            encoded[start:stop], gap_columns, tokenizer.pad_token_id, device
        )  # (B, T) each
        cache = None if prefix is None else prefix.expand(model, rows, attention_mask)
        picker = None
        if picking:
            picker = RowPicker(
                stop - start,
                gen.new_tokens,
                temperature=gen.temperature if crn else 0.0,
                top_p=gen.top_p,
                seeds=None if seeds is None else seeds[start:stop],
                record_logprobs=logprobs is not None,
                device=device,
            )
        teacher = None if reference_ids is None else reference_ids[start:stop]
        if drop_rows:
            new = decode_rows(
                model, input_ids, attention_mask, kwargs, cache=cache, rows=rows,
                set_rows=set_rows, guard=guard, guard_offset=start, picker=picker,
                teacher=teacher, teacher_logprobs=reference_logprobs, draft=reference_draft,
                stopping=stopping,
            )  # fmt: skip
        else:
            if teacher is not None and reference_logprobs is not None:
                margin = isinstance(reference_logprobs, MarginSink)
                reference_logprobs.extend(
                    _teacher_pass(model, tokenizer, encoded[start:stop], teacher, margin)
                )
            if stopping is not None:
                stopping.width = input_ids.shape[1]
            new = _generate(
                model, input_ids, attention_mask, kwargs, cache, guard, start, stop, picker,
                stopping,
            )  # fmt: skip
        if picker is not None and logprobs is not None:
            logprobs.extend(picker.row_logprobs(stop_lengths(list(new), torch.tensor(stops))))
        if out_ids is not None:
            lengths = stop_lengths(list(new), torch.tensor(stops))
            out_ids.extend(row[:n].tolist() for row, n in zip(new, lengths, strict=True))
        new_tokens += int((new != tokenizer.pad_token_id).sum())
        completions.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
        if progress is not None:
            progress(stop - start)
    return completions, new_tokens


def _teacher_pass(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    teacher: Sequence[Sequence[int]],
    margin: bool = False,
) -> list[list[float]]:
    """Teacher-forced log-probs of ``teacher`` after ``prompts`` in a forward of their own (for
    models the decode loop does not cover); the rows' candidates are already set."""
    from essa.backends.teacher import token_logprobs_rows

    pairs = [(list(p), list(t)) for p, t in zip(prompts, teacher, strict=True)]
    return token_logprobs_rows(
        model, pairs, pad_id=tokenizer.pad_token_id, micro_batch_size=len(pairs), margin=margin
    )


def _generate(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    kwargs: dict[str, Any],
    cache: Any,
    guard: NonFiniteGuard | None,
    start: int,
    stop: int,
    picker: RowPicker | None = None,
    stopping: ToolCallStop | None = None,
) -> torch.Tensor:
    """HF ``generate`` for models the row-dropping loop does not cover; new tokens (B, T_new)."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    processors = LogitsProcessorList() if guard is None else guard.processors(start, stop)
    raw: list[torch.Tensor] = []  # the model's own logits of the current step, (B, V)
    hook = None
    if picker is not None:
        processors.append(_PickerProcessor(picker, input_ids.shape[1], raw, guard))
        hook = model.register_forward_hook(functools.partial(_keep_last_logits, raw))
    extra: dict[str, Any] = {"logits_processor": processors} if processors else {}
    if cache is not None:
        extra[cache_argument(model)] = cache
    if stopping is not None:
        extra["stopping_criteria"] = StoppingCriteriaList([stopping])
    try:
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **extra, **kwargs)
    finally:
        if hook is not None:
            hook.remove()
    if guard is not None:
        guard.flush()
    return out[:, input_ids.shape[1] :].cpu()


def _keep_last_logits(raw: list[torch.Tensor], module: Any, args: Any, output: Any) -> None:
    """Forward hook: keep the last position's logits, as float32 (as ``generate`` casts them)."""
    raw[:] = [output.logits[:, -1].to(dtype=torch.float32, copy=True)]


class _PickerProcessor:
    """For ``generate``: the picker's token becomes the only choice of greedy decoding.

    ``generate`` hands a processor the scores after its own processors (repetition penalty,
    ...); the picker records log-probs of the model's raw distribution, as in ``decode_rows``,
    so it reads the step's logits that the forward hook kept in ``raw``.
    """

    def __init__(
        self,
        picker: RowPicker,
        prompt_width: int,
        raw: list[torch.Tensor],
        guard: NonFiniteGuard | None,
    ) -> None:
        self.picker = picker
        self.prompt_width = prompt_width
        self.raw = raw
        self.guard = guard

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width
        origin = torch.arange(scores.shape[0])
        logits = self.raw[0].to(scores.device)  # (B, V)
        if self.guard is not None:  # non-finite rows: EOS only, as decode_rows hands them over
            _, logits = self.guard.check(logits)
        tokens = self.picker.pick(logits, scores, origin, step)  # (B,)
        only = torch.full_like(scores, float("-inf"))
        return only.scatter_(1, tokens[:, None].to(scores.device), 0.0)


def _greedy(gen: GenerationConfig) -> GenerationConfig:
    from dataclasses import replace

    return replace(gen, temperature=0.0)


def caches_prefix(model: Any, prefix_len: int) -> bool:
    """Whether :func:`generate_texts` encodes a shared prefix of ``prefix_len`` tokens once:
    long enough to be worth it, on a cache layout :mod:`essa.backends.cache` handles."""
    return prefix_len >= MIN_PREFIX_TOKENS and fast_cache_layout(model)


def shared_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """Length of the longest common prefix that leaves every sequence one token of its own.

    >>> shared_prefix_length([[1, 2, 3, 4], [1, 2, 5]])
    2
    >>> shared_prefix_length([[1, 2], [1, 2, 3]])
    1
    """
    if not sequences:
        return 0
    limit = min(len(s) for s in sequences) - 1
    first = sequences[0]
    length = 0
    while length < limit and all(s[length] == first[length] for s in sequences):
        length += 1
    return length


def pad_rows(
    rows: Sequence[Sequence[int]], prefix_len: int, pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), each (B, T), laid out as [prefix][pads][own tokens].

    The shared prefix stays in the same columns of every row, so one cached prefix serves them
    all; with ``prefix_len`` 0 this is plain left padding. ``generate`` takes positions from the
    mask's cumulative sum, so a row's own tokens sit at positions ``prefix_len``, +1, ... in both
    layouts, and both compute the same logits under full attention. A sliding window counts
    columns, pads included, so models with one keep plain left padding and get the prefix
    cache in each row's own columns instead (``PrefixStates.expand`` with the mask).
    """
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
    for i, row in enumerate(rows):
        own = len(row) - prefix_len
        input_ids[i, :prefix_len] = torch.as_tensor(row[:prefix_len], dtype=torch.long)
        input_ids[i, width - own :] = torch.as_tensor(row[prefix_len:], dtype=torch.long)
        attention_mask[i, :prefix_len] = 1
        attention_mask[i, width - own :] = 1
    return input_ids.to(device), attention_mask.to(device)


_cache_argument = cache_argument  # its former name here, still imported by callers


@dataclass
class PrefixStates:
    """The shared prefix's keys and values for each candidate in ``candidates``."""

    candidates: torch.Tensor  # (G,) sorted candidate ids; row g of every tensor is candidates[g]
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), (G, H_kv, L, D)

    def expand(
        self, model: Any, rows: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> Any:
        """A fresh cache of the model's layout with one row per batch row (B,).

        ``attention_mask`` (B, T) is the rows' mask: in its first L columns, each row's prefix
        tokens fill the attended columns (the whole-row layout puts them after the row's left
        padding); None: the prefix fills the first L columns of every row. Sliding-window
        layers keep their last ``window - 1`` columns (the cache's own bookkeeping), which is
        why the prefix states hold every column. ``generate`` extends the cache in place.
        """
        from transformers import DynamicCache

        index = torch.searchsorted(self.candidates, rows)  # (B,)
        width = self.layers[0][0].shape[2]
        seen = (
            torch.ones((len(rows), width), dtype=torch.long)
            if attention_mask is None
            else attention_mask[:, :width]
        )  # (B, L)
        data = [
            (place_prefix(keys, index, seen), place_prefix(values, index, seen))  # (B, H, L, D)
            for keys, values in self.layers
        ]
        return DynamicCache(ddp_cache_data=data, config=model.config)


def prefix_states(
    model: Any,
    prefix: Sequence[int],
    row_candidates: torch.Tensor,
    micro_batch_size: int,
    set_rows: Callable[[torch.Tensor], None] | None,
) -> PrefixStates:
    """Run the prefix once for each candidate that appears in ``row_candidates`` (N,).

    The run keeps every column of every layer (:func:`unwindowed_cache`), sliding-window layers
    included: rows with more left padding need older prefix columns inside their window.
    """
    device = model_device(model)
    candidates = torch.unique(row_candidates)  # (G,), sorted
    keep_one = "logits_to_keep" in inspect.signature(model.forward).parameters
    chunks: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    for start in range(0, len(candidates), micro_batch_size):
        group = candidates[start : start + micro_batch_size]  # (g,)
        if set_rows is not None:
            set_rows(group)
        cache = unwindowed_cache()
        ids = torch.as_tensor(prefix, dtype=torch.long, device=device).expand(len(group), -1)
        # Only the cache is wanted: logits_to_keep=1 skips the (g, L, V) logits.
        model(
            input_ids=ids,  # (g, L)
            use_cache=True,
            **{cache_argument(model): cache},
            **({"logits_to_keep": 1} if keep_one else {}),
        )
        full_layers: list[Any] = cache.layers  # DynamicLayer only (unwindowed_cache)
        chunks.append([(layer.keys, layer.values) for layer in full_layers])
    layers = [
        (torch.cat([c[i][0] for c in chunks]), torch.cat([c[i][1] for c in chunks]))
        for i in range(len(chunks[0]))
    ]
    return PrefixStates(candidates, layers)


def _generate_kwargs(gen: GenerationConfig, tokenizer: Any, stops: list[int]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "max_new_tokens": gen.new_tokens,
        "pad_token_id": tokenizer.pad_token_id,
        # The union, not the tokenizer's EOS alone: that would replace the model's stop list.
        "eos_token_id": stops or None,
    }
    if gen.temperature > 0:
        kwargs.update(do_sample=True, temperature=gen.temperature, top_p=gen.top_p)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    return kwargs
