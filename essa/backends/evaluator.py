"""Population evaluation on the HF backend: many candidates, one batched generate.

Two strategies produce the same completions (tested to 1e-5 in logits, identical greedy text):

* ``batched``: every target linear carries per-row singular values, so rows of one generate call
  belong to different candidates; the shared projections are computed once (ESSA spec §5).
* ``merged``: per candidate, fold gamma * B'A' into the weights, generate, restore bit-exactly.

``auto`` measures both on the first population it sees (half the candidates each, so nothing is
evaluated twice) and keeps the faster per-candidate cost; it is re-measured when the number of
prompts changes. Near the crossover one probe is noise (the two within a few percent), so while
the summed costs differ by less than ``PROBE_MARGIN`` it probes again on the next populations,
swapping which half gets which strategy, for at most ``MAX_PROBES`` populations. On quantised
(bitsandbytes) and on bfloat16/float16 weights ``auto`` is ``batched`` and ``merged`` is refused:
W0 is called as is, never modified, and the candidate path runs in float32. Rows are candidate-major: row ``i`` of a P x N evaluation is candidate ``i // N``.

Held-out scores take one path whoever asks (``heldout_completions``): ESSA's held-out pass (a
greedy call with one candidate), the gradient recipes' and ``essa eval``. The adapter runs in
PEFT's factor form (``essa.adapters.population.one_adapter``), the rows shortest first in
micro-batches of ``evaluation.micro_batch_size`` with the shared prefix encoded once, so one
adapter gets the same completions bit for bit, in bf16 as in fp32 (docs/inference.md).

In both strategies, when the prompts share a token prefix (a system prompt, a chat header), that
prefix is run once per candidate and its KV cache reused by the candidate's rows
(``evaluation.use_prefix_cache``; see ``essa.backends.generate.generate_texts``).

Faults: a candidate whose logits turn NaN/inf is flagged in ``nonfinite`` (the recipe gives it
NaN fitness) instead of being graded on garbage; an out-of-memory error halves the micro-batch
and retries the call (logged), down to one sequence per forward, before it becomes a UserError.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from essa.adapters import PopulationLoRA, SVDAdapter, merged_candidate
from essa.adapters.population import HALF_DTYPES, LoRAFactors, one_adapter, peft_factors
from essa.backends.decode import NonFiniteGuard
from essa.backends.generate import generate_texts
from essa.backends.stops import ToolCallStop
from essa.backends.teacher import MarginSink
from essa.config import EvaluationConfig, GenerationConfig, PythonToolConfig
from essa.errors import UserError
from essa.protocols import RowProgress
from essa.tools.turns import ToolTally
from essa.types import Population

log = logging.getLogger(__name__)

T = TypeVar("T")
PROBE_MARGIN = 0.10  # `auto` decides once one strategy's summed cost is this much lower
MAX_PROBES = 3  # ... or after this many probed populations, on the summed costs


def length_order(
    ids: Sequence[Sequence[int]], refs: Sequence[Sequence[int]] | None, candidates: int
) -> torch.Tensor:
    """The rows of a P x n evaluation, shortest first: flat indices ``c * n + i`` (P * n,).

    A micro-batch is padded to its longest row (prompt plus teacher-forced reference), so rows
    of one prompt's candidates go together and prompts of similar length share micro-batches:
    on a task whose prompts vary in length this removes most of the padding the candidate-major
    order had (every micro-batch then holds every prompt). Ties keep prompt order.
    """
    n = len(ids)
    lengths = [len(ids[i]) + (len(refs[i]) if refs is not None else 0) for i in range(n)]
    prompts = sorted(range(n), key=lambda i: lengths[i])
    return torch.tensor([c * n + i for i in prompts for c in range(candidates)], dtype=torch.long)


def heldout_completions(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    gen: GenerationConfig,
    *,
    micro_batch_size: int,
    factors: LoRAFactors | None = None,
    progress: RowProgress | None = None,
    guard: NonFiniteGuard | None = None,
) -> tuple[list[str], int]:
    """(greedy completions, new tokens) of one model on held-out ``prompts``: the one path that
    every held-out score takes, so that an adapter scores the same wherever it is scored.

    ``model`` is a bare base model with the adapter's ``factors`` (an ESSA candidate's A', B'),
    or a PeftModel (its LoRA read as factors) or any model as it is (no factors). LoRA runs as
    ``FactorLinear`` (W0 x + gamma B (A x), the LoRA term in float32 for half models), not as
    PEFT's layers. Rows run shortest first (``length_order``), ``micro_batch_size`` at a time,
    with the prompts' shared prefix encoded once (``generate_texts``), in the decode loop where
    the model allows it. ``guard`` flags non-finite rows, in prompt order.
    """
    from dataclasses import replace

    if factors is None:
        model, factors = peft_factors(model)
    ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    order = length_order(ids, None, 1).tolist()  # (n,) prompts, shortest first
    ordered = None if guard is None else NonFiniteGuard(len(order), guard.eos_token_id)
    with one_adapter(model, factors):
        texts, tokens = generate_texts(
            model, tokenizer, [prompts[i] for i in order], replace(gen, temperature=0.0),
            micro_batch_size=micro_batch_size, use_prefix_cache=True, guard=ordered,
            progress=progress, token_ids=[ids[i] for i in order],
        )  # fmt: skip
    back = torch.argsort(torch.tensor(order)).tolist()  # prompt -> its row
    if guard is not None and ordered is not None:
        guard.rows |= ordered.rows[torch.tensor(back, dtype=torch.long)]
    return [texts[back[i]] for i in range(len(prompts))], tokens


def is_out_of_memory(err: BaseException) -> bool:
    """True for an accelerator or host out-of-memory error (torch raises several kinds)."""
    import torch

    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(err, RuntimeError) and "out of memory" in str(err).lower()


def halving_on_oom(run: Callable[[int], T], micro_batch_size: int, what: str) -> tuple[T, int]:
    """``run(micro_batch_size)``; on out-of-memory, the micro-batch halved and ``run`` again
    (logged), down to one sequence per forward, then a UserError naming ``what`` ran out.
    Returns the result and the micro-batch size that held."""
    while True:
        try:
            return run(micro_batch_size), micro_batch_size
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            if micro_batch_size == 1:
                raise UserError(
                    f"out of memory during {what} even at one sequence per forward; "
                    "lower generation.max_new_tokens or use a smaller or quantised model "
                    f"({type(err).__name__})"
                ) from None
            _release_memory()
            smaller = max(1, micro_batch_size // 2)
            log.warning(
                "out of memory with micro_batch_size=%d (%s); retrying with %d",
                micro_batch_size,
                type(err).__name__,
                smaller,
            )
            micro_batch_size = smaller


def _release_memory() -> None:
    # The failed call's activations are garbage now; hand the cached blocks back to the
    # allocator so that the retry can use them (the one place we empty the CUDA cache).
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
        tools: PythonToolConfig | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.adapter = adapter
        self.gen = gen
        self.cfg = cfg
        self.chosen: dict[int, str] = {}  # number of prompts -> strategy picked by `auto`
        self._probe_costs: dict[int, dict[str, float]] = {}  # prompts -> summed probe costs
        self.stats = EvalStats()
        self.micro_batch_size = cfg.micro_batch_size  # halved on out-of-memory, never raised
        self.nonfinite = np.zeros(0, dtype=bool)  # (P,) of the last call: non-finite logits
        self._flags: list[bool] = []  # per candidate of the current call, in order
        self._progress: RowProgress | None = None  # of the current call: rows done
        self._row_seeds: list[int] | None = None  # of the current call: CRN streams per prompt
        # Set by a recipe whose reward needs them (self_confidence): the generated tokens'
        # log-probs of the last call, last_logprobs[candidate][item][token].
        self.record_logprobs = False
        self.last_logprobs: list[list[list[float]]] = []
        # With ``references`` in a call: each reference's teacher-forced token log-probs under
        # each candidate, from the generation's own prefill: [candidate][item][token].
        self.last_reference_logprobs: list[list[list[float]]] = []
        # Set by a recipe (reward.reference_signal: margin): the reference tokens' margins to
        # the greedy choice instead of their log-probs (essa.backends.teacher.MarginSink).
        self.reference_margin = False
        self._reference_ids: list[list[int]] | None = None  # of the current call, per item
        # Prompt -> token ids: every prompt is tokenised once per run, not every generation.
        self._token_ids: dict[str, list[int]] = {}
        # Tool-integrated rollouts (essa.backends.tool_turns): their use since the last take.
        self.tools = tools if tools is not None and tools.max_tool_calls > 0 else None
        self._tool_stop: ToolCallStop | None = None
        self.tool_tally = ToolTally()
        dtypes = {model.get_submodule(name).weight.dtype for name in adapter.module_names}
        # bitsandbytes int8/int4 weights cannot take a merged delta, and bf16/fp16 ones would
        # round the candidates together (essa.adapters.merged): only `batched` applies.
        self.quantized = any(not dtype.is_floating_point for dtype in dtypes)
        self.half = bool(dtypes & set(HALF_DTYPES))
        if self.quantized and cfg.strategy == "merged":
            raise UserError(
                "evaluation.strategy: merged cannot fold candidates into quantised (int8/int4) "
                "weights; use batched or auto"
            )
        if self.half and cfg.strategy == "merged":
            raise UserError(
                "evaluation.strategy: merged would round W0 + dW to half precision and lose "
                "the difference between candidates; use batched or auto (or model.dtype: "
                "float32)"
            )

    def completions(
        self,
        population: Population,
        prompts: Sequence[str],
        seed: int | None = None,
        progress: RowProgress | None = None,
        samples: int = 1,
        references: Sequence[str | None] | None = None,
        *,
        greedy: bool = False,
    ) -> list[list[str]]:
        """Return completions[candidate][item] for population (P, D), item ``i * samples + j``
        being sample j of prompt i.

        With sampling (``generation.temperature > 0``) and a ``seed``, sample j of prompt i
        draws from the stream ``row_seed(seed, i, j)`` for every candidate (common random
        numbers, essa.backends.sampling): identical candidates get identical samples wherever
        they sit in the population. Afterwards ``nonfinite`` (P,) marks the candidates whose
        logits were NaN/inf, and with ``record_logprobs`` ``last_logprobs`` holds the
        generated tokens' log-probs. ``progress(rows)`` is called after each micro-batch.
        With ``references`` (one per prompt, None for none), ``last_reference_logprobs`` holds
        each reference's teacher-forced token log-probs after its prompt under each candidate,
        computed in the generation's prefill (a few extra tokens per row, no second pass).
        ``greedy`` decodes greedily whatever ``generation.temperature`` (held-out scoring); one
        greedy candidate without references is a held-out score and takes the held-out path
        (:func:`heldout_completions`), which other recipes and ``essa eval`` share.
        """
        from dataclasses import replace

        from essa.backends.sampling import row_seed

        population = np.atleast_2d(population)
        heldout = samples == 1 and references is None and self.tools is None
        if greedy and heldout and len(population) == 1:
            self._flags, self._progress = [], progress
            try:
                return self._run("heldout", population, prompts, None)
            finally:
                self._progress = None
        if greedy and self.gen.temperature > 0:
            sampling, self.gen = self.gen, replace(self.gen, temperature=0.0)
            try:
                return self.completions(population, prompts, seed, progress, samples, references)
            finally:
                self.gen = sampling

        expanded = [p for p in prompts for _ in range(samples)]  # prompt-major
        self._reference_ids = None
        self.last_reference_logprobs = []
        if references is not None:
            refs = [r or "" for r in references for _ in range(samples)]
            ids = self.tokenizer(refs, add_special_tokens=False)["input_ids"]
            self._reference_ids = [list(i) for i in ids]
        self._row_seeds = None
        if seed is not None and self.gen.temperature > 0:
            self._row_seeds = [
                row_seed(seed, i, j) for i in range(len(prompts)) for j in range(samples)
            ]
        self._progress = progress
        self.last_logprobs = []
        try:
            return self._completions(population, expanded, seed)
        finally:
            self._progress = None

    def _heldout(
        self, vector: np.ndarray, prompts: Sequence[str]
    ) -> tuple[list[list[str]], int, list[bool]]:
        """One candidate's held-out completions, on the path ``essa eval`` scores its export."""
        factors = {
            name: (a, b, self.adapter.module(name).gamma)
            for name, (a, b) in self.adapter.factors(vector).items()
        }
        guard = self._guard(len(prompts))
        self.last_logprobs, self.last_reference_logprobs = [], []
        texts, tokens = heldout_completions(
            self.model, self.tokenizer, prompts, self.gen, factors=factors,
            micro_batch_size=self.micro_batch_size, progress=self._progress, guard=guard,
        )  # fmt: skip
        return [texts], tokens, [bool(guard.rows.any())]

    def reference_logprobs(
        self, population: Population, prompts: Sequence[str], continuations: Sequence[str]
    ) -> list[list[list[float]]]:
        """Teacher-forced token log-probs of ``continuations[i]`` after ``prompts[i]`` under
        each candidate: [candidate][item][token] (batched rows, essa.backends.teacher)."""
        from essa.backends.teacher import population_token_logprobs

        return population_token_logprobs(
            self.model,
            self.tokenizer,
            self.adapter,
            np.atleast_2d(population),
            prompts,
            continuations,
            micro_batch_size=self.micro_batch_size,
        )

    def _completions(
        self, population: Population, prompts: Sequence[str], seed: int | None
    ) -> list[list[str]]:
        self._flags = []
        strategy: str = self.cfg.strategy
        if strategy == "auto" and (self.quantized or self.half):
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
        out, tokens, flags = self._retrying(strategy, population, prompts, seed)
        self._flags.extend(flags)
        self.nonfinite = np.array(self._flags, dtype=bool)
        self.stats.seconds += time.perf_counter() - start
        self.stats.new_tokens += tokens
        self.stats.sequences += len(population) * len(prompts)
        return out

    def _retrying(
        self, strategy: str, population: Population, prompts: Sequence[str], seed: int | None
    ) -> tuple[list[list[str]], int, list[bool]]:
        """Run one strategy; on out-of-memory halve ``micro_batch_size`` and run it again."""

        def attempt(micro_batch_size: int) -> tuple[list[list[str]], int, list[bool]]:
            self.micro_batch_size = micro_batch_size
            if strategy == "heldout":
                return self._heldout(population[0], prompts)
            if strategy == "batched":
                return self._batched(population, prompts, seed)
            return self._merged(population, prompts, seed)

        out, self.micro_batch_size = halving_on_oom(attempt, self.micro_batch_size, "evaluation")
        return out

    def _probe(
        self, population: Population, prompts: Sequence[str], seed: int | None
    ) -> list[list[str]]:
        """Time each strategy on half the candidates; decide once the faster one is clear."""
        n = len(prompts)
        if n not in self._probe_costs:
            # First calls pay one-off costs; run each once on one row, outside timing and stats.
            progress, self._progress = self._progress, None
            self._retrying("batched", population[:1], prompts[:1], seed)
            self._retrying("merged", population[:1], prompts[:1], seed)
            self.last_logprobs = []  # the warm-up rows are not part of the answer
            self.last_reference_logprobs = []
            self._progress = progress
            self._probe_costs[n] = {"batched": 0.0, "merged": 0.0, "probes": 0.0}
        costs = self._probe_costs[n]
        half = len(population) // 2
        order = ("batched", "merged") if costs["probes"] % 2 == 0 else ("merged", "batched")
        parts: list[list[list[str]]] = []
        for strategy, rows in zip(order, (population[:half], population[half:]), strict=True):
            start = time.perf_counter()
            parts.append(self._run(strategy, rows, prompts, seed))
            costs[strategy] += (time.perf_counter() - start) / len(rows)
        costs["probes"] += 1
        batched, merged = costs["batched"], costs["merged"]
        self.stats.strategy_seconds = {
            "batched": batched / costs["probes"],
            "merged": merged / costs["probes"],
        }
        clear = max(batched, merged) > (1 + PROBE_MARGIN) * min(batched, merged)
        if clear or costs["probes"] >= MAX_PROBES:
            self.chosen[n] = "batched" if batched <= merged else "merged"
        return parts[0] + parts[1]

    def token_ids(self, prompts: Sequence[str]) -> list[list[int]]:
        """Token ids of ``prompts`` (no special tokens), tokenising only unseen ones."""
        unseen = [p for p in dict.fromkeys(prompts) if p not in self._token_ids]
        if unseen:
            encoded = self.tokenizer(unseen, add_special_tokens=False)["input_ids"]
            self._token_ids.update(zip(unseen, encoded, strict=True))
        return [self._token_ids[p] for p in prompts]

    def _references(self, n: int) -> list[list[int]] | None:
        """The current call's reference ids for its ``n`` rows (a probe's warm-up runs one)."""
        return None if self._reference_ids is None else self._reference_ids[:n]

    def take_tool_metrics(self) -> dict[str, float]:
        """Tool use (essa.tools.turns.ToolTally) since the last take; empty without tools."""
        if self.tools is None:
            return {}
        tally, self.tool_tally = self.tool_tally, ToolTally()
        return tally.metrics()

    def _generate(self, prompts: Sequence[str], **kwargs: Any) -> tuple[list[str], int]:
        """generate_texts, or with tools its turn-by-turn form (tool outputs in the texts)."""
        if self.tools is None:
            return generate_texts(self.model, self.tokenizer, prompts, self.gen, **kwargs)
        from essa.backends.tool_turns import generate_turns
        from essa.rewards.extract import extract_answer

        if self._tool_stop is None:
            self._tool_stop = ToolCallStop(self.tokenizer, self.tools)
        kwargs.pop("reference_draft", None)
        texts, tokens, transcripts = generate_turns(
            self.model, self.tokenizer, kwargs.pop("token_ids"), self.gen, self.tools,
            stopping=self._tool_stop, **kwargs,
        )  # fmt: skip
        finals = [extract_answer(t.turns[-1]) if t.turns else None for t in transcripts]
        self.tool_tally.add(transcripts, finals)
        return texts, tokens

    def _reference_sink(self) -> list[list[float]]:
        return MarginSink() if self.reference_margin else []

    def _guard(self, n_rows: int) -> NonFiniteGuard:
        return NonFiniteGuard(n_rows, self.tokenizer.eos_token_id)

    def _batched(
        self, population: Population, prompts: Sequence[str], seed: int | None
    ) -> tuple[list[list[str]], int, list[bool]]:
        n, p = len(prompts), len(population)
        ids = self.token_ids(prompts)
        refs = self._references(n)
        order = length_order(ids, refs, p)  # (P * n,) flat index c * n + i, by row length
        items = [int(k) % n for k in order]
        guard = self._guard(p * n)
        seeds = None if self._row_seeds is None else [self._row_seeds[i] for i in items]
        logprobs: list[list[float]] | None = [] if self.record_logprobs else None
        ref_logprobs = None if refs is None else self._reference_sink()
        with PopulationLoRA(self.model, self.adapter) as pop:
            pop.set_population(population)
            texts, tokens = self._generate(
                [prompts[i] for i in items],
                micro_batch_size=self.micro_batch_size,
                row_candidates=order // n,  # (P * n,)
                set_rows=pop.set_rows,
                seed=seed,
                use_prefix_cache=self.cfg.use_prefix_cache,
                guard=guard,
                progress=self._progress,
                token_ids=[ids[i] for i in items],
                row_seeds=seeds,
                logprobs=logprobs,
                reference_ids=None if refs is None else [refs[i] for i in items],
                reference_logprobs=ref_logprobs,
                reference_draft=self.cfg.reference_draft,
            )
        back = torch.argsort(order).tolist()  # flat index -> its row
        if logprobs is not None:
            self.last_logprobs.extend(
                [logprobs[back[c * n + i]] for i in range(n)] for c in range(p)
            )
        if ref_logprobs is not None:
            self.last_reference_logprobs.extend(
                [ref_logprobs[back[c * n + i]] for i in range(n)] for c in range(p)
            )
        flagged = guard.rows[torch.as_tensor(back, dtype=torch.long)].view(
            p, n
        )  # (P, n) candidate-major
        out = [[texts[back[c * n + i]] for i in range(n)] for c in range(p)]
        return out, tokens, flagged.any(dim=1).tolist()

    def _merged(
        self, population: Population, prompts: Sequence[str], seed: int | None
    ) -> tuple[list[list[str]], int, list[bool]]:
        out: list[list[str]] = []
        tokens = 0
        flags: list[bool] = []
        token_ids = self.token_ids(prompts)
        refs = self._references(len(prompts))
        # Kept apart until every candidate is done: an out-of-memory retry runs them all again.
        all_logprobs: list[list[list[float]]] = []
        all_ref_logprobs: list[list[list[float]]] = []
        for vector in population:
            guard = self._guard(len(prompts))
            logprobs: list[list[float]] | None = [] if self.record_logprobs else None
            ref_logprobs = None if refs is None else self._reference_sink()
            with merged_candidate(self.model, self.adapter, vector):
                texts, new = self._generate(
                    prompts,
                    micro_batch_size=self.micro_batch_size,
                    seed=seed,
                    use_prefix_cache=self.cfg.use_prefix_cache,
                    guard=guard,
                    progress=self._progress,
                    token_ids=token_ids,
                    row_seeds=self._row_seeds,
                    logprobs=logprobs,
                    reference_ids=refs,
                    reference_logprobs=ref_logprobs,
                    reference_draft=self.cfg.reference_draft,
                )
            if logprobs is not None:
                all_logprobs.append(logprobs)
            if ref_logprobs is not None:
                all_ref_logprobs.append(ref_logprobs)
            out.append(texts)
            flags.append(bool(guard.rows.any()))
            tokens += new
        self.last_logprobs.extend(all_logprobs)
        self.last_reference_logprobs.extend(all_ref_logprobs)
        return out, tokens, flags
