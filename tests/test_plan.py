"""The budget plan (essa.es.plan): lengths from the data, phases sized to run.max_wall_seconds, a
budget too small refused before SFT, SFT's time limit and loss check, and the plan kept across
a resume. Pure sizing on hand-made costs; the rest on the demo model through the real CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from essa.config import Config, load_config
from essa.errors import UserError
from essa.es.plan import (
    CHECKS_SHARE,
    MIN_PROMPT_SHARE,
    SFT_SHARE,
    START_SHARE,
    TARGET_GENERATIONS,
    Costs,
    Plan,
    TaskLengths,
    auto_max_new_tokens,
    generation_sizes,
    length_warning,
    make_plan,
    resolve_lengths,
)
from essa.setup import plan_inputs
from tests.test_train_e2e import essa, sets

REAL = [
    "model.name_or_path=some/real-model",
    "generation.max_new_tokens=20",
    "run.max_wall_seconds=1140",
    "run.generations=40",
    "data.batch_size=32",
    "optimizer.population_size=16",
    "optimizer.start=scale_baseline",
    "optimizer.mirrored=true",
    "sft.steps=48",
    "sft.batch_size=8",
]


def real_cfg(*extra: str):  # type: ignore[no-untyped-def]
    return load_config(None, [*REAL, *extra])


def real_plan(cfg: Config) -> Plan:
    """``cfg``'s plan on a probe's typical costs, with 500 test and 5000 training items."""
    return make_plan(
        plan_inputs(cfg), Costs(row=0.05, sft_step=1.5, spent=10), test_items=500,
        train_items=5000,
    )  # fmt: skip


def lengths(reference_max: int) -> TaskLengths:
    return TaskLengths(116.0, 130, 58, reference_max - 2.0, reference_max)


def test_auto_max_new_tokens_holds_the_longest_reference_and_its_stop() -> None:
    assert auto_max_new_tokens(lengths(2)) == 2 + 1 + 2  # at least 2 tokens of slack
    assert auto_max_new_tokens(lengths(24)) == 24 + 1 + 3  # an eighth of the longest
    assert auto_max_new_tokens(lengths(100_000)) == 1024  # capped


def test_a_fixed_length_too_short_for_the_references_warns_with_the_numbers() -> None:
    short = dataclasses.replace(lengths(18), references_over=2, references=4)
    line = length_warning(12, short)
    assert line is not None
    assert "max_new_tokens=12" in line and "50%" in line and "longest 18" in line
    assert "at least 19" in line
    assert length_warning(19, lengths(18)) is None


def test_resolve_lengths_measures_on_the_models_tokenizer() -> None:
    from essa.backends.models import load_tokenizer
    from essa.config import ModelConfig

    tokenizer = load_tokenizer(ModelConfig())  # the bundled demo's real tokenizer
    cfg = load_config(None, ["generation.max_new_tokens=auto"])
    prompts = ["12+7=", "3+45="]
    refs = ["19", "48"]
    resolved, measured, warning = resolve_lengths(cfg.generation, tokenizer, prompts, refs)
    longest = max(len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in refs)
    assert measured.reference_max == longest and warning is None
    assert resolved.new_tokens == auto_max_new_tokens(measured)
    fixed = load_config(None, ["generation.max_new_tokens=1"])
    same, counted, warning = resolve_lengths(fixed.generation, tokenizer, prompts, refs)
    assert same.new_tokens == 1 and warning is not None
    assert counted.references_over == 2 and counted.references == 2


def test_generous_budget_keeps_the_configured_sizes() -> None:
    cfg = real_cfg()
    plan = make_plan(
        plan_inputs(cfg), Costs(row=0.01, sft_step=1.0, spent=10), test_items=500, train_items=5000
    )
    assert plan.prompts == 32 and plan.generations == 40
    assert plan.sft_steps == 48 and plan.sft_seconds == 48.0  # the steps fit: no limit binds


def test_expensive_rows_shrink_every_sized_phase_within_bounds() -> None:
    # A long-prompt task measured before any planning: 0.29 s per row on 2 cores.
    cfg = real_cfg()
    plan = make_plan(
        plan_inputs(cfg), Costs(row=0.29, sft_step=6.6, spent=15), test_items=500, train_items=5000
    )
    budget = 1140
    assert plan.sft_seconds == pytest.approx(SFT_SHARE * budget)
    assert plan.start_prompts == max(16, int(START_SHARE * budget / (8 * 0.29)))
    assert plan.checks == 4 and plan.check_items == int(CHECKS_SHARE * budget / (4 * 0.29))
    assert MIN_PROMPT_SHARE * 32 <= plan.prompts <= 32 and 8 <= plan.population <= 16
    assert plan.population < 16 and plan.prompts == 16  # prompts shrink first, then candidates
    assert sum(plan.seconds.values()) <= budget  # the plan itself fits the budget
    assert plan.seconds["held-out baseline"] == pytest.approx(500 * 0.29, abs=0.1)
    assert plan.generations >= 10


def test_doctests() -> None:
    import doctest

    import essa.es.plan as plan_module

    assert doctest.testmod(plan_module).failed == 0


def test_the_priced_checks_are_spread_over_the_generations_that_fit(tmp_path: Path) -> None:
    """A budget that fits fewer generations than run.generations checks the search's mean as
    often as it prices (run.generations // evaluation.every), closer together, so that patience
    can stop a flat search as early in the budget; the search and the budget's forecast of a
    checked step both take the planned cadence, and a plan written before it had one (a resumed
    run's checkpoint) keeps the configured cadence."""
    from essa.es.budget import Budget
    from essa.es.plan import plan_from_dict
    from essa.es.settings import RunSettings

    cfg = real_cfg()
    roomy = make_plan(
        plan_inputs(cfg), Costs(row=0.01, sft_step=1.0, spent=10), test_items=500, train_items=5000
    )
    assert roomy.generations == 40 and roomy.every == 10  # all fit: as configured
    plan = make_plan(
        plan_inputs(cfg), Costs(row=0.29, sft_step=6.6, spent=15), test_items=500, train_items=5000
    )
    assert plan.checks == 4 and 10 <= plan.generations < 40
    assert plan.every == -(-plan.generations // 4) < 10
    assert (
        f"validation checks on {plan.check_items} items every {plan.every} generations"
        in (plan.lines()[0])
    )
    state: dict[str, object] = {"plan": plan.as_dict()}
    with _harness(cfg, tmp_path) as h:
        assert h.check_every == 10
        adopted = Budget(None).adopt(h, state)
        assert h.check_every == plan.every  # the forecast of a step that ends in a check
    settings = RunSettings.planned(plan_inputs(cfg), cfg.reward, adopted, lambda _: None, {})
    assert settings.evaluation.every == plan.every
    old = {k: v for k, v in plan.as_dict().items() if k != "every"}
    settings = RunSettings.planned(
        plan_inputs(cfg), cfg.reward, plan_from_dict(old), lambda _: None, {}
    )
    assert settings.evaluation.every == 10


@pytest.mark.parametrize("row", [0.02, 0.05, 0.1, 0.2, 0.29])
def test_the_largest_generation_that_fits_the_target_is_planned(row: float) -> None:
    cfg = real_cfg()
    plan = make_plan(
        plan_inputs(cfg), Costs(row=row, sft_step=1.5, spent=10), test_items=500, train_items=5000
    )
    sizes = generation_sizes(16, 32, 32, cfg.optimizer)
    assert sizes[0] == (16, 32) and sizes[-1] == (8, 16)
    assert all(n % 2 == 0 for n, _ in sizes)  # mirrored pairs stay whole
    at = sizes.index((plan.population, plan.prompts))
    search = 1140 - sum(v for k, v in plan.seconds.items() if k != "generations")
    fits = [search >= TARGET_GENERATIONS * n * p * row for n, p in sizes]
    assert at == (fits.index(True) if any(fits) else len(sizes) - 1)
    assert plan.generations == min(40, int(search / (plan.population * plan.prompts * row)))


def test_the_drift_budgets_kl_forward_is_costed_in_each_generation() -> None:
    """kl_penalty/kl_budget add a teacher-forced forward of population x anchor prompts rows to
    each generation, at the probe's prefill rate; the anchor alone (no forward) costs nothing."""
    from essa.es.plan import ANCHOR_TEXT_TOKENS

    costs = Costs(row=0.05, sft_step=1.5, spent=10, prefill_token=0.001)
    args = {"test_items": 500, "train_items": 5000, "lengths": lengths(14)}
    plain = make_plan(plan_inputs(real_cfg()), costs, **args)
    anchored = make_plan(plan_inputs(real_cfg("optimizer.drift_budget.anchor=1")), costs, **args)
    kl = make_plan(plan_inputs(real_cfg("optimizer.drift_budget.kl_penalty=10")), costs, **args)
    assert anchored == plain
    per_generation = kl.seconds["generations"] / kl.generations
    rows = kl.population * kl.prompts * 0.05
    forward = kl.population * 8 * (58 + ANCHOR_TEXT_TOKENS + 16) * 0.001  # shared prefix 58
    assert per_generation == pytest.approx(rows + forward, abs=0.01)
    assert kl.generations < plain.generations


def test_search_rows_measured_dearer_than_held_out_rows_shrink_only_the_search() -> None:
    """After the scaled start the search's rows are priced at what its rows cost (candidates on
    training prompts with the reference tie-breaker), the held-out checks at the held-out rate."""
    cfg = plan_inputs(real_cfg())
    args = {"test_items": 500, "train_items": 5000}
    done = ("model load", "SFT", "held-out baseline", "scale baseline")
    flat = make_plan(cfg, Costs(row=0.03, sft_step=1.5, spent=200), **args, done=done)
    dear = Costs(row=0.03, sft_step=1.5, spent=200, search_row=0.1)
    measured = make_plan(cfg, dear, **args, done=done)
    assert measured.seconds["scale baseline"] == flat.seconds["scale baseline"] == 0.0
    assert (measured.checks, measured.check_items) == (flat.checks, flat.check_items)
    assert measured.seconds["held-out"] == flat.seconds["held-out"]
    per_generation = measured.seconds["generations"] / measured.generations
    assert per_generation == pytest.approx(measured.population * measured.prompts * 0.1, abs=0.01)
    assert measured.population * measured.prompts < flat.population * flat.prompts
    assert measured.generations >= TARGET_GENERATIONS  # the sizes shrank to keep the target


def test_the_scale_baselines_held_out_pass_is_priced_when_it_runs() -> None:
    costs = Costs(row=0.1, sft_step=1.5, spent=10)
    args = {"test_items": 500, "train_items": 5000}
    plain = make_plan(plan_inputs(real_cfg()), costs, **args)
    reported = make_plan(plan_inputs(real_cfg("evaluation.use_scale_baseline=true")), costs, **args)
    assert plain.start_prompts == reported.start_prompts
    extra = reported.seconds["scale baseline"] - plain.seconds["scale baseline"]
    assert extra == pytest.approx(500 * 0.1, abs=0.1)
    assert reported.seconds["generations"] < plain.seconds["generations"]


def test_the_search_is_priced_at_the_dearest_row_measured_before_it(tmp_path: Path) -> None:
    """The candidates per generation are fixed once the optimizer exists, so they are sized at
    the dearest of the probe's, the held-out baseline's and the scaled start's rows."""
    from essa.dist import get_comm
    from essa.es.budget import Budget
    from essa.harness import Harness

    cfg = plan_inputs(real_cfg())
    plan = make_plan(cfg, Costs(row=0.05, sft_step=1.5, spent=10), test_items=500,
                     train_items=5000)  # fmt: skip
    h = Harness(real_cfg(), tmp_path, resume=False, console=None, comm=get_comm("local"))
    h.say = lambda line: None  # type: ignore[method-assign]
    with h:
        for probe, scaled, dearest in [(0.2, 0.1, 0.2), (0.05, 0.3, 0.3)]:
            budget = Budget(plan, row=0.08, probe_row=probe)
            budget.remeasure_search(cfg, h, scaled * 448, 448, 500, 5000)
            assert budget.plan is not None
            assert budget.plan.costs["search_row"] == dearest
            assert budget.plan.costs["row"] == 0.08  # the held-out checks keep their rate


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [(40.0, 24), (80.0, 16), (10.0, 32), (30.0, 32)],  # 16 is the floor, 32 the batch size
)
def test_prompts_are_resized_on_the_first_generations_cost(seconds: float, expected: int) -> None:
    from essa.es.plan import resized_prompts

    # 570 s left for 19 more generations: 30 s each; the cost is linear in prompts.
    assert resized_prompts(32, seconds, 570.0, 19, 32, 32) == expected
    assert resized_prompts(24, 30.0, 570.0, 19, 20, 32) == 20  # never above the training items
    assert resized_prompts(20, 30.0, 570.0, 0, 32, 32) == 20  # the target is already made


def test_the_search_resizes_its_prompts_and_keeps_the_new_plan(tmp_path: Path) -> None:
    """After generation 1 the budget re-sizes the prompts on that generation's seconds: the new
    plan is printed, written to plan.json and handed back (the recipe keeps it in its
    checkpoint); a generation that fits changes nothing."""
    from essa.dist import get_comm
    from essa.es.budget import PLAN_NAME, Budget
    from essa.harness import Harness

    cfg = real_cfg()
    plan = real_plan(cfg)
    assert (plan.population, plan.prompts) == (16, 32)
    lines: list[str] = []
    h = Harness(cfg, tmp_path, resume=False, console=None, comm=get_comm("local"))
    h.say = lines.append  # type: ignore[method-assign]  # the console's lines, kept
    with h:
        budget = Budget(plan)
        assert budget.resize_prompts(h, 1.0, 1, 40, 32, 32) is None  # it fits: no change
        slow = 3 * plan.budget / TARGET_GENERATIONS  # 32 prompts take 3/20 of the budget
        resized = budget.resize_prompts(h, slow, 1, 40, 32, 32)
    assert resized is not None and budget.plan == resized
    assert resized.prompts == MIN_PROMPT_SHARE * 32 and resized.population == 16  # the floor
    assert resized.generations < TARGET_GENERATIONS  # and even there the target does not fit
    assert resized.seconds["generations"] == pytest.approx(resized.generations * slow / 2, abs=0.1)
    assert json.loads((tmp_path / PLAN_NAME).read_text())["prompts"] == resized.prompts
    assert lines == [
        f"plan: {resized.prompts} prompts per generation from now on, was 32 (a generation took "
        f"{slow:.1f} s; {resized.generations} generations fit)"
    ]


def test_mpi_ranks_share_the_rows() -> None:
    cfg = real_cfg()
    costs = Costs(row=0.29, sft_step=6.6, spent=15)
    one = make_plan(plan_inputs(cfg), costs, test_items=500, train_items=5000)
    four = make_plan(plan_inputs(cfg), costs, test_items=500, train_items=5000, world_size=4)
    assert four.seconds["held-out baseline"] == pytest.approx(500 * 0.29 / 4, abs=0.1)
    assert four.generations * four.prompts >= one.generations * one.prompts


def test_a_budget_too_small_for_a_useful_search_is_one_line_saying_what_fits() -> None:
    cfg = real_cfg("run.max_wall_seconds=300")
    with pytest.raises(UserError) as err:
        make_plan(
            plan_inputs(cfg),
            Costs(row=0.29, sft_step=6.6, spent=15),
            test_items=500,
            train_items=5000,
        )
    text = str(err.value)
    assert "\n" not in text and text.startswith("run.max_wall_seconds: 300 s holds")
    need = int(text.split("raise it to at least ")[1].split(" s")[0])
    # The number it names is enough: a plan with that budget passes.
    ok = real_cfg(f"run.max_wall_seconds={need}")
    plan = make_plan(
        plan_inputs(ok), Costs(row=0.29, sft_step=6.6, spent=15), test_items=500, train_items=5000
    )
    assert plan.generations >= 10
    # After SFT a re-plan never raises: it takes the smallest sizes.
    late = make_plan(
        plan_inputs(cfg),
        Costs(row=0.29, sft_step=6.6, spent=200),
        test_items=500,
        train_items=5000,
        done=("SFT", "held-out baseline"),
        strict=False,
    )
    assert (late.population, late.prompts) == (8, 16) and late.generations == 0


# ------------------------------------------------------------------------------ robustness
def _harness(cfg, run_dir: Path):  # type: ignore[no-untyped-def]
    from essa.dist import get_comm
    from essa.harness import Harness

    h = Harness(cfg, run_dir, resume=False, console=None, comm=get_comm("local"))
    h.say = lambda line: None  # type: ignore[method-assign]
    return h


def test_a_first_generation_past_the_budget_plans_no_negative_generations(tmp_path: Path) -> None:
    """The search's first generation ended after the budget: the re-sized plan holds the one
    generation done and no negative seconds, in memory and in plan.json."""
    from essa.es.budget import PLAN_NAME, Budget

    cfg = real_cfg()
    plan = real_plan(cfg)
    with _harness(cfg, tmp_path) as h:
        h.elapsed_before = plan.budget + 300.0  # the first generation ended 5 minutes late
        budget = Budget(plan)
        resized = budget.resize_prompts(h, 3 * plan.budget / TARGET_GENERATIONS, 1, 40, 32, 32)
    saved = json.loads((tmp_path / PLAN_NAME).read_text())
    assert resized is not None and resized.generations == saved["generations"] == 1
    assert all(v >= 0 for v in saved["seconds"].values()), saved["seconds"]


@pytest.mark.parametrize("zero", ["row", "search_row"])
def test_a_row_measured_at_zero_seconds_plans_the_configured_sizes(zero: str) -> None:
    """A clock too coarse for one row reads 0 s: the plan prices it at the clock's tick (the
    configured sizes all fit) instead of dividing by it."""
    cfg = real_cfg()
    costs = dataclasses.replace(Costs(row=0.05, sft_step=1.5, spent=10), **{zero: 0.0})
    plan = make_plan(plan_inputs(cfg), costs, test_items=500, train_items=5000)
    assert (plan.population, plan.prompts, plan.generations) == (16, 32, 40)


def test_a_generation_measured_at_zero_seconds_resizes_without_dividing_by_zero(
    tmp_path: Path,
) -> None:
    from essa.es.budget import Budget

    cfg = real_cfg()
    plan = real_plan(cfg)
    with _harness(cfg, tmp_path) as h:
        budget = Budget(plan)
        resized = budget.resize_prompts(h, 0.0, 1, 40, 20, 32)  # only 20 training prompts
    assert resized is not None and resized.prompts == 20 and resized.generations == 40


def test_a_run_resumed_before_its_first_checkpoint_re_plans_on_the_probes_costs(
    tmp_path: Path,
) -> None:
    """plan.json keeps the probe's costs: a run killed before its first checkpoint re-reads
    them on resume and re-plans after the held-out baseline on them, not on 0 s."""
    from essa.es.budget import Budget

    cfg = real_cfg()
    inputs = plan_inputs(cfg)
    probed = Costs(row=0.05, sft_step=1.5, spent=10, prefill_token=0.002)
    plan = make_plan(inputs, probed, test_items=500, train_items=5000)
    first = Budget(plan, sft_step=1.5, prefill_token=0.002, row=0.05, probe_row=0.05)
    with _harness(cfg, tmp_path) as h:
        first.announce(h, "")  # what the first process wrote before it was killed
        resumed = Budget.start(inputs, h, True, lengths(20), None, None, None, [])
        resumed.remeasure(inputs, h, 0.04 * 500, 500, 5000)
        resumed.remeasure_search(inputs, h, 0.01 * 448, 448, 500, 5000)
    assert resumed.plan is not None
    assert resumed.plan.costs["sft_step"] == 1.5 and resumed.plan.costs["prefill_token"] == 0.002
    assert resumed.plan.costs["search_row"] == 0.05  # the probe's row, the dearest measured


def test_the_probe_halves_its_micro_batch_on_out_of_memory(tmp_path: Path) -> None:
    """The probe meets an out-of-memory error as the evaluator does: the micro-batch halves
    until it fits, and the costs come from the attempt that held. No GPU here: the model's
    forward is wrapped to raise torch.OutOfMemoryError (what CUDA raises) above 4 rows."""
    import torch

    from essa.backends.models import load_model
    from essa.config import ModelConfig
    from essa.data.loaders import builtin_examples
    from essa.es.plan import measure_task, probe_costs

    model, tokenizer = load_model(ModelConfig())
    pool, _ = builtin_examples("builtin:arithmetic")
    prompts = [ex.prompt for ex in pool[:16]]
    task = measure_task(tokenizer, prompts, [ex.target for ex in pool[:16]])
    batches: list[int] = []

    def out_of_memory_above_four_rows(module, args, kwargs):  # type: ignore[no-untyped-def]
        ids = kwargs.get("input_ids", args[0] if args else None)
        batches.append(ids.shape[0])
        if ids.shape[0] > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model.register_forward_pre_hook(out_of_memory_above_four_rows, with_kwargs=True)
    cfg = load_config(None, ["evaluation.micro_batch_size=16", "generation.max_new_tokens=4"])
    costs = probe_costs(model, tokenizer, prompts, plan_inputs(cfg), 1.0, task)
    assert costs.row > 0 and costs.sft_step > 0
    assert 16 in batches and max(batches[batches.index(4) :]) == 4  # 16 -> 8 -> 4, then kept


# ------------------------------------------------------------------------------ SFT limit
def _sft_setup():  # type: ignore[no-untyped-def]
    """The demo model with a fresh LoRA, its A factors drawn from a fixed seed (PEFT draws them
    from the global generator: what a test sees must not depend on which tests ran first)."""
    import torch

    from essa.backends.models import load_model
    from essa.config import AdapterConfig, ModelConfig
    from essa.data.loaders import builtin_examples
    from essa.gradient.sft import make_lora_model

    model, tokenizer = load_model(ModelConfig())
    torch.manual_seed(0)
    peft_model = make_lora_model(model, AdapterConfig())
    pool, _ = builtin_examples("builtin:arithmetic")
    return peft_model, tokenizer, pool[:64], [ex.prompt for ex in pool[:64]]


def test_sft_time_limit_cuts_the_schedule_so_the_rate_still_decays() -> None:
    from essa.config import SFTConfig
    from essa.gradient.sft import SFTLimit, train_sft

    peft_model, tokenizer, examples, prompts = _sft_setup()
    rates: list[float] = []
    limit = SFTLimit(seconds=0.0, check=[], check_prompts=[])
    losses = train_sft(
        peft_model,
        tokenizer,
        examples,
        prompts,
        SFTConfig(steps=50, batch_size=4),
        seed=0,
        progress=lambda f: rates.append(f["lr"]),
        limit=limit,
    )
    assert len(losses) == 2 and limit.stopped == "time" and limit.steps_done == 2
    assert rates[0] > 0 and rates[1] < rates[0]  # the cosine ran over the 2 steps that fit


def test_sft_stops_when_its_check_loss_stops_improving() -> None:
    from essa.config import SFTConfig
    from essa.gradient.sft import SFTLimit, train_sft

    peft_model, tokenizer, examples, prompts = _sft_setup()
    # lr 0: the loss cannot improve, so the check stops SFT after patience + 1 checks.
    limit = SFTLimit(3600.0, examples[:8], prompts[:8], checks=10, patience=2)
    losses = train_sft(
        peft_model, tokenizer, examples, prompts, SFTConfig(steps=40, batch_size=4, lr=0.0), 0,
        limit=limit,
    )  # fmt: skip
    assert limit.stopped == "check" and len(limit.check_losses) == 3
    assert len(losses) == 3 * 4  # a check every 40 // 10 steps
    # With learning, it runs every step.
    peft_model, tokenizer, examples, prompts = _sft_setup()
    limit = SFTLimit(3600.0, examples[:8], prompts[:8], checks=4, patience=2)
    losses = train_sft(
        peft_model, tokenizer, examples, prompts, SFTConfig(steps=12, batch_size=8, lr=3e-3), 0,
        limit=limit,
    )  # fmt: skip
    assert limit.stopped == "steps" and len(losses) == 12


# ------------------------------------------------------------------------------ end to end
TINY = [
    "sft.steps=4",
    "data.sft_size=32",
    "data.test_size=16",
    "evaluation.every=2",
    "run.generations=4",
    "run.show_progress=false",
    "data.batch_size=8",
    "optimizer.population_size=4",
]


@pytest.mark.slow
def test_a_budgeted_run_prints_its_plan_and_records_plan_vs_actual(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    res = essa("train", "--run-dir", str(run_dir), *sets(*TINY, "run.max_wall_seconds=600"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "plan: " in res.stdout and "plan seconds: " in res.stdout
    assert "re-measured on the held-out baseline" in res.stdout
    assert "re-measured on the scaled start" in res.stdout
    plan = json.loads((run_dir / "plan.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["plan"] == plan and summary["max_new_tokens"] == 8
    phases = [json.loads(x) for x in (run_dir / "phases.jsonl").read_text().splitlines()]
    planned = {p["phase"] for p in phases if "planned_seconds" in p}
    assert {"SFT", "held-out baseline", "scale baseline", "generations"} <= planned
    assert set(summary["phases"]) == set(plan["seconds"])
    for name, row in summary["phases"].items():
        assert row["planned"] == plan["seconds"][name] and row["actual"] >= 0
    # The checks during the search scored the planned subsample; the ends, the whole split.
    passes = [json.loads(x) for x in (run_dir / "heldout_scores.jsonl").read_text().splitlines()]
    sizes = [len(p["scores"]) for p in passes]
    assert sizes[0] == 16 and sizes[-1] == 16
    assert all(n == min(16, plan["check_items"]) for n in sizes[1:-1])
    assert summary["search_seconds"] > 0


@pytest.mark.slow
def test_a_budget_too_small_fails_before_sft_in_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    res = essa("train", "--run-dir", str(run_dir), *sets(*TINY, "run.max_wall_seconds=0.5"))
    assert res.returncode == 2, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert lines[-1].startswith("error: run.max_wall_seconds: 0.5 s holds"), res.stderr
    assert "Traceback" not in res.stderr
    assert not (run_dir / "sft_adapter").exists()  # nothing trained


def test_the_checks_are_sized_on_the_validation_split_and_priced_before_the_search() -> None:
    """The search's checks score validation: at most its items each, and the SFT adapter's and
    the scaled start's validation passes before the search are priced with them."""
    cfg = real_cfg()
    costs = Costs(row=0.05, sft_step=1.5, spent=10)
    on_test = make_plan(plan_inputs(cfg), costs, test_items=500, train_items=5000)
    on_val = make_plan(plan_inputs(cfg), costs, test_items=500, train_items=5000, val_items=100)
    assert on_test.check_items > 100 and on_val.check_items == 100
    passes = on_val.checks + 2  # the SFT adapter and the scaled start (smollm2 starts scaled)
    assert on_val.seconds["held-out"] == pytest.approx(passes * 100 * 0.05, abs=0.1)
    assert "validation checks on 100 items" in on_val.lines()[0]
