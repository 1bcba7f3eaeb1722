"""Population evaluation on the HF backend: many candidates, one batched generate.

Two strategies produce the same completions (tested to 1e-5 in logits, identical greedy text):

* ``batched``: every target linear carries per-row singular values, so rows of one generate call
  belong to different candidates; the shared projections are computed once (ESSA spec §5).
* ``merged``: per candidate, fold gamma * B'A' into the weights, generate, restore bit-exactly.

``auto`` measures both on the first population it sees (half the candidates each, so nothing is
evaluated twice) and keeps the faster per-candidate cost; it is re-measured when the number of
prompts changes. On quantised (bitsandbytes) weights ``auto`` is ``batched`` and ``merged`` is
refused: W0 is called as is, never modified. Rows are candidate-major: row ``i`` of a P x N evaluation is candidate ``i // N``.

In both strategies, when the prompts share a token prefix (a system prompt, a chat header), that
prefix is run once per candidate and its KV cache reused by the candidate's rows
(``evaluation.use_prefix_cache``; see ``essa.backends.hf.generate_texts``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from essa.adapters import PopulationLoRA, SVDAdapter, candidate_rows, merged_candidate
from essa.backends.hf import generate_texts
from essa.config import EvaluationConfig, GenerationConfig
from essa.errors import UserError
from essa.types import Population


@dataclass
class EvalStats:
    seconds: float = 0.0
    new_tokens: int = 0
    sequences: int = 0
    strategy_seconds: dict[str, float] = field(default_factory=dict)  # per-candidate cost probe


class PopulationEvaluator:
    """Generate completions for a population of candidates on shared prompts."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        adapter: SVDAdapter,
        gen: GenerationConfig,
        cfg: EvaluationConfig,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.adapter = adapter
        self.gen = gen
        self.cfg = cfg
        self.chosen: dict[int, str] = {}  # number of prompts -> strategy picked by `auto`
        self.stats = EvalStats()
        # bitsandbytes int8/int4 weights cannot take a merged delta: only `batched` applies.
        self.quantized = any(
            not model.get_submodule(name).weight.is_floating_point()
            for name in adapter.module_names
        )
        if self.quantized and cfg.strategy == "merged":
            raise UserError(
                "evaluation.strategy: merged cannot fold candidates into quantised (int8/int4) "
                "weights; use batched or auto"
            )

    def completions(
        self, population: Population, prompts: Sequence[str], seed: int | None = None
    ) -> list[list[str]]:
        """Return completions[candidate][prompt] for population (P, D)."""
        population = np.atleast_2d(population)
        strategy = self.cfg.strategy
        if strategy == "auto" and self.quantized:
            strategy = self.chosen[len(prompts)] = "batched"
        if strategy == "auto":
            strategy = self.chosen.get(len(prompts), "")
            if not strategy and len(population) >= 2:
                return self._probe(population, prompts, seed)
            strategy = strategy or "batched"
        return self._run(strategy, population, prompts, seed)

    def _run(
        self, strategy: str, population: Population, prompts: Sequence[str], seed: int | None
    ) -> list[list[str]]:
        start = time.perf_counter()
        if strategy == "batched":
            out, tokens = self._batched(population, prompts, seed)
        else:
            out, tokens = self._merged(population, prompts, seed)
        self.stats.seconds += time.perf_counter() - start
        self.stats.new_tokens += tokens
        self.stats.sequences += len(population) * len(prompts)
        return out

    def _probe(
        self, population: Population, prompts: Sequence[str], seed: int | None
    ) -> list[list[str]]:
        """Time each strategy on half the candidates and remember the faster one."""
        half = len(population) // 2
        # First calls pay one-off costs; run each once on one row, outside the timing and stats.
        self._batched(population[:1], prompts[:1], seed)
        self._merged(population[:1], prompts[:1], seed)
        cost: dict[str, float] = {}
        parts: list[list[list[str]]] = []
        for strategy, rows in (("batched", population[:half]), ("merged", population[half:])):
            start = time.perf_counter()
            parts.append(self._run(strategy, rows, prompts, seed))
            cost[strategy] = (time.perf_counter() - start) / len(rows)
        self.chosen[len(prompts)] = min(cost, key=cost.__getitem__)
        self.stats.strategy_seconds = cost
        return parts[0] + parts[1]

    def _batched(
        self, population: Population, prompts: Sequence[str], seed: int | None
    ) -> tuple[list[list[str]], int]:
        n = len(prompts)
        rows = [p for _ in range(len(population)) for p in prompts]  # candidate-major
        with PopulationLoRA(self.model, self.adapter) as pop:
            pop.set_population(population)
            texts, tokens = generate_texts(
                self.model,
                self.tokenizer,
                rows,
                self.gen,
                micro_batch_size=self.cfg.micro_batch_size,
                row_candidates=candidate_rows(len(population), n),  # (P * n,)
                set_rows=pop.set_rows,
                seed=seed,
                use_prefix_cache=self.cfg.use_prefix_cache,
            )
        return [texts[c * n : (c + 1) * n] for c in range(len(population))], tokens

    def _merged(
        self, population: Population, prompts: Sequence[str], seed: int | None
    ) -> tuple[list[list[str]], int]:
        out: list[list[str]] = []
        tokens = 0
        for vector in population:
            with merged_candidate(self.model, self.adapter, vector):
                texts, new = generate_texts(
                    self.model,
                    self.tokenizer,
                    prompts,
                    self.gen,
                    micro_batch_size=self.cfg.micro_batch_size,
                    seed=seed,
                    use_prefix_cache=self.cfg.use_prefix_cache,
                )
            out.append(texts)
            tokens += new
        return out, tokens
