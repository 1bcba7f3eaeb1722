"""The run's budget plan: the task measured on the model's tokenizer, a timed probe, and every
phase sized so that the search gets most of ``run.max_wall_seconds``.

An ESSA run spends its wall-clock in phases (model load, SFT, the SFT adapter's held-out pass,
the scaled start, held-out checks during the search, the generations, the final held-out pass
and the drift report; only the export, a write, comes after the budget). A config tuned on one
task sizes them by hand; on a task with 3x longer prompts the same sizes leave the search one
generation. The plan, made before SFT, reads what the task costs on this machine and sizes what
may be sized:

* ``generation.max_new_tokens: auto``: the longest reference answer in tokens plus the stop
  token and a slack (:func:`auto_max_new_tokens`); a fixed value shorter than the references is
  one warning with the numbers (:func:`length_warning`);
* SFT: at most ``sft.steps`` steps and at most :data:`SFT_SHARE` of the budget, stopping early
  when its check loss on training prompts (never the held-out split) stops improving;
* held-out checks during the search: a fixed subsample of the held-out split (the final pass
  and the SFT adapter's keep the whole split), together at most :data:`CHECKS_SHARE`; the
  ``run.generations // evaluation.every`` checks it prices are spread over the generations
  that fit (:func:`check_every`), so that a run cut short by its budget still checks its mean
  as often, and its patience stops a flat search as early in the budget;
* the scaled start (``optimizer.start: scale_baseline``): its training prompts bounded so that
  it takes at most :data:`START_SHARE`;
* prompts, then candidates per generation: lowered until :data:`TARGET_GENERATIONS`
  generations fit, prompts down to half of ``data.batch_size`` and candidates down to half of
  ``optimizer.population_size`` at most.

A budget that holds fewer than :data:`USEFUL_GENERATIONS` generations at the smallest sizes is
refused in one line before SFT. The per-row cost comes from a probe (greedy rows of the
training prompts on the base model, timed to their first token and to the end, costed at a
reference's length: :func:`probe_costs`) and is measured again on the SFT adapter's held-out
pass, where the population machinery runs; the sizes that come after that pass are re-planned
with the measured cost. Plan and actual seconds per phase go to phases.jsonl and the summary.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from essa.config import (
    AdapterConfig,
    DataConfig,
    EvaluationConfig,
    GenerationConfig,
    OptimizerConfig,
    RunConfig,
    SFTConfig,
)
from essa.errors import UserError

SFT_SHARE = 0.15  # SFT stops at this share of the budget at the latest
START_SHARE = 0.05  # the scaled start's rows
CHECKS_SHARE = 0.05  # all held-out checks during the search together
TARGET_GENERATIONS = 20  # prompts per generation shrink until this many fit ...
MIN_PROMPT_SHARE = 0.5  # ... but never below this share of data.batch_size, then candidates
MIN_POPULATION_SHARE = 0.5  # shrink, never below this share of optimizer.population_size
USEFUL_GENERATIONS = 10  # fewer at the smallest sizes: the budget is refused before SFT
MIN_CHECK_ITEMS = 32  # a held-out check during the search scores at least this many items
MIN_START_PROMPTS = 16  # the scaled start's factors are compared on at least this many prompts
AUTO_TOKEN_CAP = 1024  # generation.max_new_tokens: auto never exceeds this
PROBE_ROWS = 16  # greedy rows the probe times (after one untimed warm-up row)
SFT_CHECK_ITEMS = 32  # training examples whose loss checks SFT (never held-out ones)
SFT_CHECKS = 6  # loss checks over sft.steps (every steps // SFT_CHECKS steps)
SFT_PATIENCE = 2  # checks without improvement before SFT stops
SFT_BACKWARD_FACTOR = 3.0  # a training step costs about 3 forwards (forward + backward)
MIN_SECONDS = 1e-6  # a measured time below this (0 on a coarse clock) is priced at this
# An anchor prompt past the template's shared part: its off-task text (4-8 tokens on SmolLM2's
# tokenizer, essa.drift.offtask.OFFTASK_TEXTS) and the template's closing tokens.
ANCHOR_TEXT_TOKENS = 10


@dataclass(frozen=True)
class TaskLengths:
    """Token counts of the task on the model's tokenizer (prompts as rendered)."""

    prompt_mean: float  # rendered prompt tokens, mean
    prompt_max: int
    shared_prefix: int  # tokens every prompt starts with (a system prompt, a chat header)
    reference_mean: float  # reference answer (SFT target) tokens, mean
    reference_max: int
    references_over: int = 0  # references longer than a fixed max_new_tokens leaves room for
    references: int = 0

    def as_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


def measure_task(
    tokenizer: Any,
    prompts: Sequence[str],
    references: Sequence[str],
    max_new_tokens: int | None = None,
) -> TaskLengths:
    """Lengths of ``prompts`` (rendered) and ``references`` (what SFT teaches the model to
    write after a prompt) in tokens, as generation and SFT tokenise them; with a fixed
    ``max_new_tokens``, how many references it cannot hold with their stop token."""
    from essa.backends.generate import shared_prefix_length

    p = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    r = [len(x) for x in tokenizer(list(references), add_special_tokens=False)["input_ids"]]
    return TaskLengths(
        prompt_mean=round(statistics.fmean(len(x) for x in p), 1),
        prompt_max=max(len(x) for x in p),
        shared_prefix=shared_prefix_length(p),
        reference_mean=round(statistics.fmean(r), 1),
        reference_max=max(r),
        references_over=0 if max_new_tokens is None else sum(n + 1 > max_new_tokens for n in r),
        references=len(r),
    )


def auto_max_new_tokens(lengths: TaskLengths) -> int:
    """Room for the longest reference, its stop token, and a slack for a candidate that words
    it slightly longer (an eighth of it, at least 2 tokens); at most :data:`AUTO_TOKEN_CAP`."""
    slack = max(2, lengths.reference_max // 8)
    return min(AUTO_TOKEN_CAP, lengths.reference_max + 1 + slack)


def length_warning(max_new_tokens: int, lengths: TaskLengths) -> str | None:
    """One line when a fixed ``max_new_tokens`` cannot hold some references and their stop."""
    if not lengths.references_over:
        return None
    share = lengths.references_over / lengths.references
    return (
        f"warning: generation.max_new_tokens={max_new_tokens} cannot hold {share:.0%} of the "
        f"reference answers with their stop token (longest {lengths.reference_max} tokens + "
        "1): those completions are cut and score 0; use generation.max_new_tokens: auto or "
        f"raise it to at least {lengths.reference_max + 1}"
    )


def reference_texts(examples: Sequence[Any]) -> list[str]:
    """What the model learns to write after a prompt: each example's SFT target."""
    return [ex.target for ex in examples]


def resolve_lengths(
    gen: GenerationConfig, tokenizer: Any, prompts: Sequence[str], references: Sequence[str]
) -> tuple[GenerationConfig, TaskLengths, str | None]:
    """``gen`` with ``max_new_tokens`` resolved (auto -> a number), the lengths it came from,
    and a warning line when a fixed value is too short for the references."""
    fixed = gen.max_new_tokens if isinstance(gen.max_new_tokens, int) else None
    lengths = measure_task(tokenizer, prompts, references, fixed)
    if fixed is not None:
        return gen, lengths, length_warning(fixed, lengths)
    return dataclasses.replace(gen, max_new_tokens=auto_max_new_tokens(lengths)), lengths, None


# ---------------------------------------------------------------------------------------------
# Costs and the plan


@dataclass(frozen=True)
class PlanInputs:
    """The config sections the plan reads (``essa.setup.plan_inputs`` takes them from a config)."""

    run: RunConfig  # the budget, the generations, whether to plan
    optimizer: OptimizerConfig  # candidates per generation, the scaled start
    data: DataConfig  # prompts per generation
    generation: GenerationConfig  # resolved: max_new_tokens is a number
    evaluation: EvaluationConfig  # held-out checks, the scale baseline, the probe's micro-batch
    sft: SFTConfig  # SFT's steps and batch
    adapter: AdapterConfig  # a given adapter (adapter.path) needs no SFT
    backend: Literal["hf", "vllm"] = "hf"  # only the HF backend plans


@dataclass(frozen=True)
class Costs:
    """Seconds measured on this machine (the slowest rank's under MPI)."""

    row: float  # one greedy row of a training prompt, generated to its end, in a micro-batch
    sft_step: float  # one SFT step (estimated from the probe's forward until SFT runs)
    spent: float  # seconds of the run before the plan (model load, probe)
    prefill_token: float = 0.0  # one token of a teacher-forced forward, at the probe's rate
    # One row of the search (a candidate on a training prompt, with the reference tie-breaker
    # and the per-row singular values); ``row`` until the scaled start has measured one.
    search_row: float | None = None
    report: float = 0.0  # the drift report after the search (measured before it; 0: not yet)

    @property
    def train_row(self) -> float:
        return self.row if self.search_row is None else self.search_row


@dataclass(frozen=True)
class Plan:
    """The sizes a run uses and the seconds each phase is expected to take."""

    budget: float
    max_new_tokens: int
    sft_steps: int  # at most; SFT may stop earlier on its check or its time
    sft_seconds: float  # SFT's time limit
    check_items: int  # validation items of each check during the search
    checks: int  # held-out checks during the search
    start_prompts: int  # the scaled start's training prompts (0: no scaled start)
    population: int  # candidates per generation
    prompts: int  # prompts per generation
    generations: int  # generations expected to fit
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> expected seconds
    lengths: dict[str, float | int] = field(default_factory=dict)
    costs: dict[str, float] = field(default_factory=dict)
    # Generations between validation checks (check_every); 0: evaluation.every as configured
    every: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def search_share(self) -> float:
        return self.seconds.get("generations", 0.0) / self.budget if self.budget else 0.0

    def lines(self) -> list[str]:
        """The plan as the console prints it: one line of sizes, one of seconds."""
        sizes = (
            f"plan: {self.generations} generations of {self.population} candidates x "
            f"{self.prompts} prompts in "
            f"{self.budget:.0f} s (search {self.search_share():.0%}); max_new_tokens "
            f"{self.max_new_tokens}"
        )
        if self.sft_steps:  # a re-plan after SFT has none left to size
            sizes += f"; SFT up to {self.sft_steps} steps / {self.sft_seconds:.0f} s"
        sizes += f"; validation checks on {self.check_items} items"
        if self.every:
            sizes += f" every {self.every} generations"
        if self.start_prompts:
            sizes += f"; scaled start on {self.start_prompts} prompts"
        phases = ", ".join(f"{k} {v:.0f} s" for k, v in self.seconds.items())
        return [sizes, f"plan seconds: {phases}"]


def probe_costs(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    cfg: PlanInputs,
    spent: float,
    lengths: TaskLengths,
) -> Costs:
    """Time :data:`PROBE_ROWS` greedy rows of ``prompts`` on ``model``: once to their first
    token (the prefill) and once to ``max_new_tokens`` (every row of the base model runs to the
    end). A trained adapter's rows stop after about a reference's length, so a row is costed
    as the prefill plus the decode of ``reference_mean + 1`` tokens. One SFT step costs about
    :data:`SFT_BACKWARD_FACTOR` forwards of its tokens, at the prefill's rate."""
    import torch

    from essa.backends.evaluator import halving_on_oom
    from essa.backends.generate import caches_prefix, generate_texts

    gen = dataclasses.replace(cfg.generation, temperature=0.0)
    rows = [prompts[i % len(prompts)] for i in range(PROBE_ROWS)]
    micro_batch = cfg.evaluation.micro_batch_size

    def timed(max_new_tokens: int) -> float:
        """Seconds of the rows to ``max_new_tokens``; an out-of-memory micro-batch is halved
        as the evaluator halves it, and only the attempt that held is timed."""
        nonlocal micro_batch

        def attempt(size: int) -> float:
            start = time.perf_counter()
            generate_texts(
                model,
                tokenizer,
                rows,
                dataclasses.replace(gen, max_new_tokens=max_new_tokens),
                micro_batch_size=size,
                use_prefix_cache=cfg.evaluation.use_prefix_cache,
            )
            return time.perf_counter() - start

        seconds, micro_batch = halving_on_oom(attempt, micro_batch, "the budget probe")
        return seconds

    with torch.no_grad():
        generate_texts(model, tokenizer, rows[:1], gen, micro_batch_size=1)  # warm-up
        prefill = timed(1)
        whole = timed(gen.new_tokens)
    per_token = max(0.0, whole - prefill) / max(1, gen.new_tokens - 1)  # decode, all rows
    decoded = min(gen.new_tokens, lengths.reference_mean + 1)
    row = (prefill + per_token * (decoded - 1)) / len(rows)
    cached = cfg.evaluation.use_prefix_cache and caches_prefix(model, lengths.shared_prefix)
    computed = probe_prefill_tokens(lengths, len(rows), cached)
    prefill_rate = computed / prefill if prefill > 0 else math.inf
    sft_tokens = cfg.sft.batch_size * (lengths.prompt_mean + lengths.reference_mean + 1)
    sft_step = SFT_BACKWARD_FACTOR * sft_tokens / prefill_rate
    return Costs(row=row, sft_step=sft_step, spent=spent, prefill_token=1.0 / prefill_rate)


def probe_prefill_tokens(lengths: TaskLengths, rows: int, prefix_cached: bool) -> float:
    """Prompt tokens the probe's prefill computes: with the shared-prefix cache the common prefix
    runs once and each row only its own suffix. SFT computes every token of every example, so
    its step is costed at this rate (counting whole prompts there priced a chain_sum SFT step at
    a third of what it took).

    >>> lengths = TaskLengths(47.0, 50, 35, 2.0, 3)
    >>> probe_prefill_tokens(lengths, 8, prefix_cached=False), probe_prefill_tokens(lengths, 8, True)
    (376.0, 131.0)
    """
    if not prefix_cached:
        return rows * lengths.prompt_mean
    return lengths.shared_prefix + rows * (lengths.prompt_mean - lengths.shared_prefix)


def make_plan(
    cfg: PlanInputs,
    costs: Costs,
    *,
    test_items: int,
    train_items: int,
    world_size: int = 1,
    lengths: TaskLengths | None = None,
    done: Collection[str] = (),
    strict: bool = True,
    val_items: int | None = None,
) -> Plan:
    """Size the phases of an ESSA run to ``run.max_wall_seconds`` (see the module docstring).

    Rows split evenly over ``world_size`` ranks. ``done``: phases already run (their seconds
    are in ``costs.spent``): "SFT" (or an adapter given), "held-out baseline". ``strict``:
    a budget that cannot hold :data:`USEFUL_GENERATIONS` generations at the smallest sizes is
    a UserError (before SFT); otherwise the smallest sizes are planned.
    """
    budget = float(cfg.run.max_wall_seconds or 0.0)
    args = (cfg, costs, test_items, train_items, world_size, lengths, done, val_items)
    plan = _sized(budget, *args)
    useful = min(USEFUL_GENERATIONS, cfg.run.generations)
    if strict and plan.generations < useful:
        # The shares grow with the budget: find the smallest one that holds a useful search.
        low, high = budget, max(2 * budget, 60.0)
        while _sized(high, *args).generations < useful:
            low, high = high, 2 * high
        while high - low > 1:
            mid = (low + high) / 2
            low, high = (low, mid) if _sized(mid, *args).generations >= useful else (mid, high)
        s = plan.seconds
        raise UserError(
            f"run.max_wall_seconds: {budget:g} s holds {plan.generations} generations of "
            f"{plan.population} candidates x {plan.prompts} prompts after model load "
            f"{s['model load']:.0f} s, SFT {s['SFT']:.0f} s, the held-out baseline "
            f"{s['held-out baseline']:.0f} s on {test_items} items, the scaled start "
            f"{s['scale baseline']:.0f} s, held-out checks {s['held-out']:.0f} s and the final "
            f"pass {s['final held-out']:.0f} s; a useful "
            f"search needs {useful}: raise it to at least {math.ceil(high)} s, or lower "
            "data.test_size or generation.max_new_tokens"
        )
    return plan


def _sized(
    budget: float,
    cfg: PlanInputs,
    costs: Costs,
    test_items: int,
    train_items: int,
    world_size: int,
    lengths: TaskLengths | None,
    done: Collection[str],
    val_items: int | None = None,
) -> Plan:
    from essa.es.start import SCALE_FACTORS, SCALE_PROMPTS

    # Seconds per row of the whole run (ranks in parallel); a row timed at 0 s (a coarse clock)
    # is priced at the clock's tick, so that the plan divides by a cost, never by zero.
    row = max(costs.row, MIN_SECONDS) / world_size
    train_row = max(costs.train_row, MIN_SECONDS) / world_size  # the start's and the search's
    o, d, e = cfg.optimizer, cfg.data, cfg.evaluation
    samples = cfg.generation.samples_per_prompt
    sft_steps = 0 if "SFT" in done or cfg.adapter.path is not None else cfg.sft.steps
    sft = min(sft_steps * costs.sft_step, SFT_SHARE * budget)
    baseline = 0.0 if "held-out baseline" in done else test_items * row
    start_prompts = 0
    if o.start == "scale_baseline" or e.use_scale_baseline:
        fit = int(START_SHARE * budget / (len(SCALE_FACTORS) * samples * train_row))
        start_prompts = min(train_items, SCALE_PROMPTS, max(MIN_START_PROMPTS, fit))
    start = 0.0
    if "scale baseline" not in done:
        start = start_prompts * len(SCALE_FACTORS) * samples * train_row
        if e.use_scale_baseline:  # the chosen factor's held-out pass, on the whole split
            start += test_items * row
    checks = cfg.run.generations // e.every if e.every else 0
    # The checks score validation (essa.es.watch); None: as many items as the test split.
    items = test_items if val_items is None else val_items
    check_items = items
    if checks:
        fit = int(CHECKS_SHARE * budget / (checks * row))
        check_items = min(items, max(MIN_CHECK_ITEMS, fit))
    # With validation, the SFT adapter's and the scaled start's passes before the search too.
    before = 0 if not val_items or "held-out baseline" in done else 1 + bool(start_prompts)
    held_out = (checks + before) * check_items * row
    # After the search, inside the budget too: the final held-out pass and the drift report.
    final = test_items * row
    fixed = costs.spent + sft + baseline + start + held_out + final + costs.report
    search = budget - fixed

    def generation(size: tuple[int, int]) -> float:
        return size[0] * size[1] * samples * train_row + anchor_forward(size[0])

    def anchor_forward(population: int) -> float:
        """The drift budget's KL forward of each generation: population x anchor prompts rows,
        teacher-forced (the template's shared part, the off-task text, the continuation)."""
        db = o.drift_budget
        if not db.uses_kl:
            return 0.0
        template = lengths.shared_prefix if lengths is not None else 0
        tokens = population * db.prompts * (template + ANCHOR_TEXT_TOKENS + db.tokens)
        return tokens * costs.prefill_token / world_size

    sizes = generation_sizes(o.population_size, min(d.batch_size, train_items), d.batch_size, o)
    target = min(TARGET_GENERATIONS, cfg.run.generations)
    # The largest generation (prompts shrink first, then candidates) that fits the target.
    size = next((s for s in sizes if search >= target * generation(s)), sizes[-1])
    population, prompts = size
    fit_generations = max(0, int(search / generation(size)))
    generations = min(cfg.run.generations, fit_generations)
    every = check_every(generations, checks, e.every)
    seconds = {
        "model load": costs.spent,
        "SFT": sft,
        "held-out baseline": baseline,
        "scale baseline": start,
        "held-out": held_out,
        "generations": generations * generation(size),
        "final held-out": final,
        "drift": costs.report,
    }
    return Plan(
        budget=budget,
        max_new_tokens=cfg.generation.new_tokens,
        sft_steps=sft_steps,
        sft_seconds=round(sft, 1),
        check_items=check_items,
        checks=checks,
        start_prompts=start_prompts,
        population=population,
        prompts=prompts,
        generations=generations,
        seconds={k: round(v, 1) for k, v in seconds.items()},
        lengths=lengths.as_dict() if lengths is not None else {},
        costs={k: round(v, 4) for k, v in dataclasses.asdict(costs).items() if v is not None},
        every=every,
    )


def check_every(generations: int, checks: int, every: int) -> int:
    """Generations between the search's validation checks: the ``checks`` the plan prices
    (``run.generations // evaluation.every``) spread over the ``generations`` that fit, never
    further apart than ``every``. A budget that fits fewer generations than ``run.generations``
    would otherwise check fewer times, and ``run.patience`` checks without a new best would
    come late in the budget or never (letter_counting: 25 generations fit, a flat search
    stopped at generation 20 of them, at 75-80% of the budget).

    >>> check_every(40, 4, 10)  # the generations the config names: as configured
    10
    >>> check_every(23, 4, 10)  # four checks over 23 generations: at 6, 12, 18 and the end
    6
    >>> check_every(0, 4, 10), check_every(23, 0, 0)  # nothing to spread
    (10, 0)
    """
    if not checks or not generations:
        return every
    return max(1, min(every, math.ceil(generations / checks)))


def generation_sizes(
    population: int, prompts: int, batch_size: int, o: OptimizerConfig
) -> list[tuple[int, int]]:
    """(candidates, prompts) per generation, largest first, within the stated bounds: prompts
    down to :data:`MIN_PROMPT_SHARE` of ``data.batch_size`` first, then candidates down to
    :data:`MIN_POPULATION_SHARE` of the population (even where pairs are antithetic)."""
    step = o.options.pair_size()  # candidates drawn together (antithetic pairs stay whole)
    floor_prompts = prompt_floor(prompts, batch_size)
    floor_population = max(step, math.ceil(MIN_POPULATION_SHARE * population / step) * step)
    floor_population = min(floor_population, population)
    sizes = [(population, p) for p in range(prompts, floor_prompts - 1, -1)]
    sizes += [(n, floor_prompts) for n in range(population - step, floor_population - 1, -step)]
    return sizes


def prompt_floor(most: int, batch_size: int) -> int:
    """The fewest prompts a generation is sized to: :data:`MIN_PROMPT_SHARE` of
    ``data.batch_size``, at most ``most`` (the prompts available)."""
    return max(1, min(most, math.ceil(MIN_PROMPT_SHARE * batch_size)))


def resized_prompts(
    prompts: int, seconds: float, remaining: float, generations_left: int, most: int, batch: int
) -> int:
    """Prompts per generation after the search's first generation: ``prompts`` took ``seconds``,
    and ``generations_left`` more (of the target) must fit in ``remaining`` seconds. The cost is
    taken as linear in prompts; the result stays between :data:`MIN_PROMPT_SHARE` of
    ``data.batch_size`` (``batch``) and ``most`` (the batch size, or fewer training items).

    >>> resized_prompts(32, 40.0, 570.0, 19, 32, 32)  # 1.25 s a prompt, 30 s a generation left
    24
    """
    floor = prompt_floor(most, batch)
    if generations_left <= 0 or seconds <= 0:
        return max(floor, min(most, prompts))
    fit = int(remaining * prompts / (generations_left * seconds))
    return max(floor, min(most, fit))


def plan_from_dict(data: dict[str, Any]) -> Plan:
    return Plan(**data)
