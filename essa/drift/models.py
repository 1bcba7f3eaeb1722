"""The three models the drift report compares (base, SFT, tuned) and how it reaches them.

:class:`PopulationModels` is ESSA's: the bare base model, and the SFT and tuned vectors as two
candidate rows of one PopulationLoRA forward. :class:`PeftModels` is GRPO's and ``essa eval``'s:
a PEFT model with its adapter switched off for the base. Both give the next-token log-probs of
each model on (prompt, continuation) pairs and each model's completions of prompts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from essa.config import GenerationConfig, PythonToolConfig
from essa.types import AdapterVector

if TYPE_CHECKING:
    from essa.adapters.svd import SVDAdapter

Pair = tuple[list[int], list[int]]  # (prompt ids, continuation ids)
NAMES = ("base", "sft", "tuned")


@torch.no_grad()
def tail_logp(model: Any, chunk: Sequence[Pair], pad_id: int) -> torch.Tensor:
    """(B, tail, V) next-token log-probs of ``model`` at the last ``max |c| + 1`` columns of
    the left-padded pairs (:func:`essa.backends.teacher.tail_log_softmax`), on the CPU."""
    import inspect

    from essa.backends.models import model_device
    from essa.backends.teacher import tail_log_softmax

    keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    logp, _ = tail_log_softmax(model, chunk, pad_id, model_device(model), keep)
    return logp.cpu()  # (B, tail, V)


def texts_of(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    gen: GenerationConfig,
    tools: PythonToolConfig | None,
    **kwargs: Any,
) -> list[str]:
    """Completions of ``prompts``: ``generate_texts``, or with ``tools`` the turn-by-turn
    rollouts the run itself makes (essa.backends.tool_turns), tool outputs in the text."""
    from essa.backends.generate import generate_texts

    if tools is None:
        return generate_texts(model, tokenizer, prompts, gen, **kwargs)[0]
    from essa.backends.tool_turns import generate_turns

    ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    return generate_turns(model, tokenizer, ids, gen, tools, **kwargs)[0]


@dataclass
class PopulationModels:
    """ESSA's models: the bare base model, and the SFT (zero offsets) and tuned vectors as the
    two candidate rows of one PopulationLoRA forward."""

    model: Any  # the bare base model
    tokenizer: Any
    adapter: SVDAdapter
    vector: AdapterVector
    micro_batch_size: int
    names: tuple[str, ...] = NAMES
    tools: PythonToolConfig | None = None  # the run's tool calls, for retention and pass@K

    def _population(self) -> np.ndarray:
        return np.stack([np.zeros_like(self.vector), np.asarray(self.vector)])  # (2, D)

    def log_softmax(
        self, chunk: Sequence[Pair], names: Sequence[str] = NAMES
    ) -> dict[str, torch.Tensor]:
        """(B, tail, V) log-probs of each of ``names`` on ``chunk``: the base alone, the SFT
        and tuned vectors as candidate rows of one forward."""
        from essa.adapters import PopulationLoRA, candidate_rows

        pad = self.tokenizer.pad_token_id
        out = {"base": tail_logp(self.model, chunk, pad)} if "base" in names else {}
        rows = [i for i, name in enumerate(("sft", "tuned")) if name in names]
        if rows:
            n = len(chunk)
            with PopulationLoRA(self.model, self.adapter) as pop:
                pop.set_population(self._population()[rows])
                pop.set_rows(candidate_rows(len(rows), n))
                logp = tail_logp(self.model, list(chunk) * len(rows), pad)  # (len(rows) B, ...)
            for c, i in enumerate(rows):
                out[("sft", "tuned")[i]] = logp[c * n : (c + 1) * n]
        return out

    def generate(
        self,
        prompts: Sequence[str],
        gen: GenerationConfig,
        names: Sequence[str],
        row_seeds: Sequence[int] | None = None,
        tools: bool = False,
    ) -> dict[str, list[str]]:
        """Completions of ``prompts`` by each of ``names``; with ``tools``, with the run's
        tool calls (``self.tools``)."""
        from essa.adapters import PopulationLoRA, candidate_rows

        calls = self.tools if tools else None
        out: dict[str, list[str]] = {}
        if "base" in names:
            out["base"] = texts_of(
                self.model,
                self.tokenizer,
                prompts,
                gen,
                calls,
                micro_batch_size=self.micro_batch_size,
                row_seeds=row_seeds,
            )
        rows = [i for i, name in enumerate(("sft", "tuned")) if name in names]
        if rows:
            n = len(prompts)
            with PopulationLoRA(self.model, self.adapter) as pop:
                pop.set_population(self._population()[rows])
                texts = texts_of(
                    self.model,
                    self.tokenizer,
                    list(prompts) * len(rows),  # candidate-major
                    gen,
                    calls,
                    micro_batch_size=self.micro_batch_size,
                    row_candidates=candidate_rows(len(rows), n),
                    set_rows=pop.set_rows,
                    row_seeds=None if row_seeds is None else list(row_seeds) * len(rows),
                )
            for c, i in enumerate(rows):
                out[("sft", "tuned")[i]] = texts[c * n : (c + 1) * n]
        return out


@dataclass
class PeftModels:
    """A PEFT model holding the tuned adapter: the base with the adapter switched off, the SFT
    values under ``sft`` (a context that loads them; None: not known), the tuned as is."""

    model: Any  # PeftModel
    tokenizer: Any
    micro_batch_size: int
    sft: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    has_base: bool = True  # False: the base weights themselves were trained (GRPO with LISA)
    tools: PythonToolConfig | None = None  # the run's tool calls, for retention and pass@K

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in NAMES if self._context(n) is not None)

    @property
    def inner(self) -> Any:
        """The HF model with the LoRA layers injected: it generates as the PEFT model does, and
        the decode loop (row dropping, per-row sampling streams) applies to it."""
        get = getattr(self.model, "get_base_model", None)
        return self.model if get is None else get()

    def _context(self, name: str) -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
        if name == "base":
            return self.model.disable_adapter if self.has_base else None
        if name == "sft":
            return self.sft
        return contextlib.nullcontext

    def log_softmax(
        self, chunk: Sequence[Pair], names: Sequence[str] = NAMES
    ) -> dict[str, torch.Tensor]:
        out = {}
        for name in (n for n in self.names if n in names):
            with self._context(name)():  # type: ignore[misc]
                out[name] = tail_logp(self.inner, chunk, self.tokenizer.pad_token_id)
        return out

    def generate(
        self,
        prompts: Sequence[str],
        gen: GenerationConfig,
        names: Sequence[str],
        row_seeds: Sequence[int] | None = None,
        tools: bool = False,
    ) -> dict[str, list[str]]:
        """As :meth:`PopulationModels.generate`."""
        out = {}
        for name in (n for n in self.names if n in names):
            with self._context(name)():  # type: ignore[misc]
                out[name] = texts_of(
                    self.inner,
                    self.tokenizer,
                    prompts,
                    gen,
                    self.tools if tools else None,
                    micro_batch_size=self.micro_batch_size,
                    row_seeds=row_seeds,
                )
        return out


Models = PopulationModels | PeftModels
