"""Drift and retention figures (essa/drift/) on the tiny in-process Qwen2: KL, update size,
the off-task set, the run's cache of base continuations and the sampled metrics."""

from __future__ import annotations

import contextlib
import doctest
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from essa.config import ConfigError, load_config
from essa.drift.models import PeftModels, PopulationModels
from essa.drift.offtask import OFFTASK_TEXTS, ContinuationCache, offtask_kl, offtask_prompts
from essa.drift.report import DriftSettings, adapter_pass_figures, measure
from essa.drift.retention import grade_samples, retention_source, retention_task
from essa.drift.update import adapter_updates, base_weights, peft_updates, update_size
from essa.setup import drift_settings
from tests.conftest import svd_setup

PROMPTS = ["12+3=", "7*8=", "45-6=", "9 9 9", "1="]


def test_doctests() -> None:
    from essa.drift import offtask, report, retention, update

    for module in (offtask, report, retention, update):
        assert doctest.testmod(module).failed == 0


def lora_model(model_dir: Path) -> tuple[Any, Any]:
    """(peft_model, tokenizer): the tiny model with a rank-4 LoRA whose B is non-zero."""
    from essa.backends.models import load_model
    from essa.config import AdapterConfig, ModelConfig
    from essa.gradient.sft import make_lora_model

    model, tokenizer = load_model(ModelConfig(name_or_path=str(model_dir)))
    peft_model = make_lora_model(model, AdapterConfig(rank=4, lora_alpha=8)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero; a trained adapter has non-zero B
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    return peft_model, tokenizer


def test_kl_of_a_model_against_itself_is_zero_and_grows_when_the_adapter_moves(
    tiny_model_dir: Path,
) -> None:
    base, tokenizer, adapter = svd_setup(tiny_model_dir)
    zero = np.zeros(adapter.dim)
    same = offtask_kl(
        PopulationModels(base, tokenizer, adapter, zero, 2), PROMPTS, 6, micro_batch_size=2
    )
    # SFT and tuned are the same vector in two rows of one forward: identical distributions.
    assert abs(same["kl_sft"]) <= 1e-7
    assert same["kl_base"] == pytest.approx(same["kl_base_sft"], abs=1e-7)
    assert same["kl_base"] > 1e-4  # the SFT adapter itself moves off the base
    assert same["kl_prompts"] == len(PROMPTS)
    # |y_i| + 1 distributions per prompt: at least one each, at most tokens + 1.
    assert len(PROMPTS) <= same["kl_positions"] <= len(PROMPTS) * 7
    moved = 0.5 * adapter.stds() * np.random.default_rng(0).standard_normal(adapter.dim)
    after = offtask_kl(
        PopulationModels(base, tokenizer, adapter, moved, 2), PROMPTS, 6, micro_batch_size=3
    )
    assert after["kl_sft"] > 1e-4
    assert after["kl_base_sft"] == pytest.approx(same["kl_base_sft"], rel=1e-5)  # the same SFT
    assert after["kl_positions"] == same["kl_positions"]  # the base's continuations are fixed
    # Per prompt, its mean KL: weighted by the prompts' positions they give the mean back.
    per_prompt = after["kl_per_prompt"]["kl_base"]
    assert len(per_prompt) == len(PROMPTS) and min(per_prompt) >= 0
    assert max(per_prompt) > 0 and min(per_prompt) <= after["kl_base"] <= max(per_prompt)


def test_peft_and_population_paths_give_the_same_figures(tiny_model_dir: Path) -> None:
    """GRPO and `essa eval` (a PEFT model) measure what ESSA's population rows measure."""
    from essa.adapters import SVDAdapter

    peft_model, tokenizer = lora_model(tiny_model_dir)
    peft = PeftModels(peft_model, tokenizer, 2, sft=contextlib.nullcontext)
    peft_kl = offtask_kl(peft, PROMPTS, 6, micro_batch_size=2)
    assert peft_kl["kl_sft"] == 0.0  # the same model run twice
    peft_size = peft_updates(peft_model, contextlib.nullcontext)
    assert peft_size is not None and peft_size["search"]["max"] == 0.0
    adapter = SVDAdapter.from_peft_model(peft_model, alpha=1.0)
    base = peft_model.unload()
    zero = np.zeros(adapter.dim)
    pop_kl = offtask_kl(
        PopulationModels(base, tokenizer, adapter, zero, 2), PROMPTS, 6, micro_batch_size=2
    )
    assert pop_kl["kl_base"] == pytest.approx(peft_kl["kl_base"], rel=1e-4)
    w0 = base_weights(base, adapter.module_names)
    assert w0 is not None
    pop_size = update_size(adapter.delta_weights(zero), w0)
    assert pop_size["mean"] == pytest.approx(peft_size["final"]["mean"], rel=1e-5)
    assert pop_size["max"] == pytest.approx(peft_size["final"]["max"], rel=1e-5)


def settings(micro_batch_size: int = 4, **drift: Any) -> DriftSettings:
    """The drift settings of a raw-template run on builtin:arithmetic, ``drift`` changed."""
    from dataclasses import replace

    from essa.config import Config, DataConfig, GenerationConfig

    cfg = Config(
        data=DataConfig(source="builtin:arithmetic", template="raw"),
        generation=GenerationConfig(max_new_tokens=6),
    )
    s = drift_settings(cfg)
    return replace(s, micro_batch_size=micro_batch_size, drift=replace(s.drift, **drift))


def test_pass_figures_are_the_final_reports_kl_and_update_and_can_be_off(
    tiny_model_dir: Path,
) -> None:
    """What every held-out pass logs is the final report's off-task KL and mean update size,
    flattened; with evaluation.drift.every_pass off it logs nothing."""
    base, tokenizer, adapter = svd_setup(tiny_model_dir)
    vector = np.full(adapter.dim, 0.5)
    s = settings()
    figures = adapter_pass_figures(s, ContinuationCache(), base, tokenizer, adapter, vector)
    models = PopulationModels(base, tokenizer, adapter, vector, 4)
    updates = adapter_updates(base, adapter, vector)
    report = measure(settings(retention="none", samples=0), models, tokenizer, [], None, updates)
    assert set(figures) == {"drift_kl_base", "drift_kl_sft", "drift_update"}
    assert figures["drift_kl_base"] == pytest.approx(report["kl_base"], rel=1e-6)
    assert figures["drift_kl_sft"] == pytest.approx(report["kl_sft"], rel=1e-6)
    assert figures["drift_kl_sft"] > 0  # the vector moved off the SFT point
    assert figures["drift_update"] == report["update"]["final"]["mean"]
    off = settings(every_pass=False)
    assert adapter_pass_figures(off, ContinuationCache(), base, tokenizer, adapter, vector) == {}
    none = adapter_pass_figures(s, ContinuationCache(), None, tokenizer, adapter, vector)
    assert none == {}  # vLLM


def test_a_run_generates_the_base_continuations_once_and_the_figures_do_not_change(
    tiny_model_dir: Path,
) -> None:
    """The run's cache: the second and later passes reuse the first pass's base continuations
    (no base generate call), and every figure equals the uncached one's; another token count,
    another prompt set or another base model generates afresh."""
    base, tokenizer, adapter = svd_setup(tiny_model_dir)
    base_calls: list[int] = []  # one entry per generate call of the base model

    class Counting(PopulationModels):
        def generate(self, prompts, gen, names, **kwargs):  # type: ignore[no-untyped-def]
            base_calls.extend([gen.max_new_tokens] if "base" in names else [])
            return super().generate(prompts, gen, names, **kwargs)

    rng = np.random.default_rng(0)
    vectors = [s * adapter.stds() * rng.standard_normal(adapter.dim) for s in (0.3, 0.6, 0.9)]
    cache = ContinuationCache()
    for vector in vectors:  # three held-out passes, each with the mean it scored
        models = Counting(base, tokenizer, adapter, vector, 2)
        cached = offtask_kl(models, PROMPTS, 6, 2, cache)
        assert base_calls == [6]  # the first pass generated; the later ones read
        fresh = offtask_kl(PopulationModels(base, tokenizer, adapter, vector, 2), PROMPTS, 6, 2)
        assert cached == fresh  # identical figures, per-prompt lists included
    models = Counting(base, tokenizer, adapter, vectors[0], 2)
    offtask_kl(models, PROMPTS, 5, 2, cache)  # another token count
    offtask_kl(models, PROMPTS[:3], 6, 2, cache)  # other prompts
    other_base, _, _ = svd_setup(tiny_model_dir)
    offtask_kl(Counting(other_base, tokenizer, adapter, vectors[0], 2), PROMPTS, 6, 2, cache)
    assert base_calls == [6, 5, 6, 6]
    # Through the report: passes and the final report share the run's cache.
    s = settings(micro_batch_size=2, retention="none", samples=0)
    base_calls.clear()
    run_cache = ContinuationCache()
    for vector in vectors:
        figures = adapter_pass_figures(s, run_cache, base, tokenizer, adapter, vector)
        uncached = adapter_pass_figures(s, ContinuationCache(), base, tokenizer, adapter, vector)
        assert figures == uncached
    models = Counting(base, tokenizer, adapter, vectors[-1], 2)
    final = measure(s, models, tokenizer, [], None, None, run_cache)
    assert final == measure(s, PopulationModels(base, tokenizer, adapter, vectors[-1], 2),
                            tokenizer, [], None)  # fmt: skip
    assert base_calls == []  # the final report read the passes' continuations


def test_update_size_matches_a_hand_computation(tiny_model_dir: Path) -> None:
    peft_model, _ = lora_model(tiny_model_dir)
    ratios = []
    for name, module in peft_model.named_modules():
        if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")):
            a = module.lora_A["default"].weight.detach().double().numpy()  # (r, n)
            b = module.lora_B["default"].weight.detach().double().numpy()  # (m, r)
            w = module.base_layer.weight.detach().double().numpy()  # (m, n)
            delta = (8 / 4) * b @ a  # lora_alpha / r
            ratios.append(np.sqrt((delta**2).sum()) / np.sqrt((w**2).sum()))
    report = peft_updates(peft_model, None)
    assert report is not None and set(report) == {"final"}  # no SFT given: no sft, no search
    assert report["final"]["matrices"] == len(ratios) == 8  # q, k, v, o of 2 layers
    assert report["final"]["mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-5)
    assert report["final"]["max"] == pytest.approx(max(ratios), rel=1e-5)


def test_offtask_prompts_are_fixed_and_leave_out_the_training_task() -> None:
    from essa.backends.models import load_model
    from essa.config import ModelConfig
    from essa.data.loaders import builtin_examples

    _, tokenizer = load_model(ModelConfig(name_or_path="builtin:demo"))
    prompts = offtask_prompts("builtin:arithmetic", 12, tokenizer)
    assert prompts == offtask_prompts("builtin:arithmetic", 12, tokenizer)
    assert len(prompts) == 12
    # The demo's digits-only vocabulary drops letters: no general-text prompt survives.
    assert not set(prompts) & set(OFFTASK_TEXTS)
    trained = {e.prompt for part in builtin_examples("builtin:arithmetic") for e in part}
    assert not set(prompts) & trained
    assert prompts[:2] == [
        builtin_examples("builtin:arithmetic3")[1][0].prompt,
        builtin_examples("builtin:arithmetic_mixed")[1][0].prompt,
    ]


def test_grade_samples_counts_full_credit_and_answer_entropy() -> None:
    def reward(texts: list[str], answers: list, rows: list[str]) -> list[float | None]:
        return [
            1.0 if t == a else (0.5 if t else None) for t, a in zip(texts, answers, strict=True)
        ]

    texts = ["3", "3", "4", "", "7", "8", "8", "8"]
    answers = ["3"] * 4 + ["7"] * 4
    report = grade_samples(texts, answers, ["p"] * 8, 4, reward)
    assert report["k"] == 4 and report["items"] == 2
    assert report["mean@4"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert report["pass@4"] == 1.0 and report["maj@4"] == 0.5  # "8" outvotes "7"
    entropy_a = -(0.5 * np.log(0.5) + 2 * 0.25 * np.log(0.25))  # 3, 3, 4, None
    entropy_b = -(0.25 * np.log(0.25) + 0.75 * np.log(0.75))
    assert report["answer_entropy"] == pytest.approx((entropy_a + entropy_b) / 2)


def test_retention_source_and_its_check() -> None:
    def source(*overrides: str) -> str | None:
        cfg = load_config(None, list(overrides))
        return retention_source(cfg.evaluation.drift, cfg.data)

    assert source() == "builtin:arithmetic_mixed"
    assert source("data.source=builtin:arithmetic_mixed") == "builtin:arithmetic"
    assert source("evaluation.drift.retention=none") is None
    assert source("evaluation.drift.items=0") is None
    with pytest.raises(ConfigError, match="evaluation.drift.retention"):
        load_config(None, ["evaluation.drift.retention=gsm8k"])
    assert source("evaluation.drift.retention=reasoning_gym:gcd") == "reasoning_gym:gcd"
    with pytest.raises(ConfigError, match="reasoning_gym:no_such_task: no such reasoning-gym"):
        load_config(None, ["evaluation.drift.retention=reasoning_gym:no_such_task"])
    with pytest.raises(ConfigError, match="is the training task"):
        load_config(None, ["data.source=builtin:arithmetic3",
                           "evaluation.drift.retention=builtin:arithmetic3"])  # fmt: skip


def test_a_reasoning_gym_retention_task_is_graded_by_its_own_scorer() -> None:
    """Held-out items of the gym task, graded with the task's score_answer: its own answers get
    full credit, a wrong one none (gym's partial credit for a wrong answer counts as wrong)."""
    examples, grader = retention_task("reasoning_gym:gcd", 5)
    prompts = [e.prompt for e in examples]
    answers = [e.answer for e in examples]
    assert len(examples) == 5
    assert grader([f"<answer>{a}</answer>" for a in answers], answers, prompts) == [1.0] * 5
    wrong = [f"<answer>{int(a) + 1}</answer>" for a in answers]
    assert all(float(s or 0.0) < 1.0 for s in grader(wrong, answers, prompts))


def test_the_report_reads_what_was_written_before_the_search(tiny_model_dir: Path) -> None:
    """warm() writes the base's off-task continuations and the base's and the SFT adapter's
    retention answers before the search: the final report then generates the tuned model
    alone, and its figures are those of a report that generated everything itself (the
    tiny model's greedy answers do not depend on which rows share a batch here)."""
    from essa.drift.report import tuned_seconds, warm

    base, tokenizer, adapter = svd_setup(tiny_model_dir)
    generated: list[tuple[str, ...]] = []  # the models of each generate call

    class Counting(PopulationModels):
        def generate(self, prompts, gen, names, **kwargs):  # type: ignore[no-untyped-def]
            generated.append(tuple(names))
            return super().generate(prompts, gen, names, **kwargs)

    s = settings(micro_batch_size=4, prompts=4, tokens=4, items=3, samples=0)
    vector = 0.8 * adapter.stds() * np.random.default_rng(0).standard_normal(adapter.dim)
    cache = ContinuationCache()
    warmed = warm(s, Counting(base, tokenizer, adapter, np.zeros(adapter.dim), 4), tokenizer, cache)
    assert generated == [("base",), ("base", "sft")]  # continuations, then retention's two
    assert warmed["retention_models"] == 2 and warmed["retention"] > 0
    generated.clear()
    final = measure(s, Counting(base, tokenizer, adapter, vector, 4), tokenizer, [], None, None,
                    cache)  # fmt: skip
    assert generated == [("tuned",)]  # the tuned model's retention, nothing else
    uncached = measure(
        s, PopulationModels(base, tokenizer, adapter, vector, 4), tokenizer, [], None
    )
    assert final == uncached
    assert final["retention"]["items"] == 3 and "change_from_sft" in final["retention"]
    # The forecast prices the tuned model's share of what was measured.
    forecast = tuned_seconds(s, warmed, row_seconds=0.0, test_items=10)
    expected = warmed["retention"] / 2 + warmed["continuations"]
    assert forecast == pytest.approx(expected, abs=0.06)


def test_pass_at_k_is_priced_on_the_starts_own_samples(tiny_model_dir: Path) -> None:
    """Before the search, warm() samples the start's pass@K on the first 8 test items (K rows
    each, the tuned row, which is the start there); the forecast prices the final pass@K at
    that rate per item, not at the greedy held-out rate per row it is given."""
    from essa.drift.report import SAMPLE_PROBE_ITEMS, tuned_seconds, warm

    base, tokenizer, adapter = svd_setup(tiny_model_dir)
    calls: list[tuple[tuple[str, ...], int]] = []  # (models, rows) of each generate call

    class Counting(PopulationModels):
        def generate(self, prompts, gen, names, **kwargs):  # type: ignore[no-untyped-def]
            calls.append((tuple(names), len(prompts)))
            return super().generate(prompts, gen, names, **kwargs)

    test, grader = retention_task("builtin:arithmetic", 12)
    s = settings(prompts=0, retention="none", items=12, samples=3)
    models = Counting(base, tokenizer, adapter, np.zeros(adapter.dim), 4)
    warmed = warm(s, models, tokenizer, ContinuationCache(), test, grader)
    assert calls == [(("tuned",), SAMPLE_PROBE_ITEMS * 3)]
    assert warmed["samples_per_item"] > 0
    forecast = tuned_seconds(s, warmed, row_seconds=1000.0, test_items=10)
    assert forecast == pytest.approx(10 * warmed["samples_per_item"], abs=0.06)
    # Without the probe (no reward to grade it), the greedy rate per row prices it.
    assert "samples_per_item" not in warm(s, models, tokenizer, ContinuationCache(), test)
    assert tuned_seconds(s, {}, row_seconds=0.5, test_items=10) == 15.0


def test_retention_generates_past_a_short_task_length(tiny_model_dir: Path) -> None:
    """A 2-token task still gets retention_tokens for retention (another task, maybe worded
    answers); the run's own length applies when it is the longer."""
    from dataclasses import replace

    from essa.config import GenerationConfig

    base, tokenizer, adapter = svd_setup(tiny_model_dir)
    lengths: list[int] = []

    class Recording(PopulationModels):
        def generate(self, prompts, gen, names, **kwargs):  # type: ignore[no-untyped-def]
            lengths.append(gen.max_new_tokens)
            return super().generate(prompts, gen, names, **kwargs)

    def run(max_new_tokens: int) -> dict[str, Any]:
        s = settings(prompts=0, items=3, samples=0, retention_tokens=5)
        s = replace(s, generation=GenerationConfig(max_new_tokens=max_new_tokens))
        models = Recording(base, tokenizer, adapter, np.zeros(adapter.dim), 4)
        return measure(s, models, tokenizer, [], None)

    report = run(2)
    assert lengths == [5] and report["retention"]["items"] == 3
    assert report["retention"]["source"] == "builtin:arithmetic_mixed"
    assert {"base", "sft", "tuned", "change_from_base"} <= set(report["retention"])
    run(7)
    assert lengths == [5, 7]


def test_a_grpo_run_generates_the_base_continuations_once(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GRPO's held-out passes and its final report read one cache, the policy's: three passes
    and the report make one base-model generation of the off-task set, and the report's KL is
    the one an uncached measurement of the final policy gives."""
    import essa.drift.offtask as offtask
    from essa.config import load_config
    from essa.recipes import grpo

    calls: list[int] = []
    real = offtask.base_continuations

    def counting(models, prompts, tokens):  # type: ignore[no-untyped-def]
        calls.append(len(prompts))
        return real(models, prompts, tokens)

    monkeypatch.setattr(offtask, "base_continuations", counting)
    cfg = load_config(None, [
        "algorithm=grpo", f"model.name_or_path={tiny_model_dir}", "grpo.prompts_per_step=2",
        "grpo.group_size=2", "reward.name=length", "reward.params={max_length: 8, unit: chars}",
        "sft.steps=2", "sft.batch_size=4", "data.sft_size=8", "data.test_size=4",
        "evaluation.every=1", "evaluation.drift.prompts=4", "evaluation.drift.items=0",
        "run.show_progress=false", "run.generations=3", "generation.max_new_tokens=8",
    ])  # fmt: skip
    (tmp_path / "run").mkdir()
    summary = grpo.run(cfg, tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert sum("drift_kl_base" in r for r in records) == 3  # a KL figure at every pass
    assert calls == [4]  # one generation of the 4 off-task prompts, read by all four
    assert summary["drift"]["kl_base"] == pytest.approx(records[-1]["drift_kl_base"])


CHOICE_PROMPTS = [*PROMPTS, "3+4=", "8-1=", "6*2=", "2*9=", "5+5="]
LABELS = ("0", "1")  # two answers of distinct first tokens: a forced choice between them


def label_logp(model: Any, tokenizer: Any, prompts: list[str]) -> torch.Tensor:
    """(N, 2) by hand: each label's log-prob as the first token after each prompt, one prompt
    per forward (no padding)."""
    firsts = [tokenizer(label, add_special_tokens=False)["input_ids"][0] for label in LABELS]
    rows = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()  # (V,)
            rows.append(torch.log_softmax(logits, -1)[firsts])
    return torch.stack(rows)  # (N, 2)


def planted(ranks: list[int]) -> list[Any]:
    from essa.types import Example

    return [Example(p, LABELS[r]) for p, r in zip(CHOICE_PROMPTS, ranks, strict=True)]


def test_forced_choice_reads_the_models_ranking_of_the_answers(tiny_model_dir: Path) -> None:
    """Answers planted as the base model's own top-ranked label score 1.0 for the base, its
    bottom-ranked 0.0, and logp is the reference's log-prob computed by hand; SFT and tuned on
    one vector choose alike, a moved tuned vector changes the log-probs."""
    from essa.drift.retention import forced_choice

    base, tokenizer, adapter = svd_setup(tiny_model_dir)
    by_hand = label_logp(base, tokenizer, CHOICE_PROMPTS)  # (N, 2)
    top = by_hand.argmax(1).tolist()
    assert 0 < sum(top) < len(top)  # both labels are some prompt's top choice
    same = PopulationModels(base, tokenizer, adapter, np.zeros(adapter.dim), 3)
    right = forced_choice(same, planted(top), CHOICE_PROMPTS, micro_batch_size=3)
    assert right is not None and right["labels"] == list(LABELS)
    assert right["base"] == 1.0 and right["auc_base"] == 1.0  # each label tops on its items
    assert right["logp_base"] == pytest.approx(float(by_hand.max(1).values.mean()), abs=1e-4)
    assert right["sft"] == right["tuned"] and right["change_from_sft"] == 0.0
    assert right["auc_change_from_sft"] == 0.0
    wrong = forced_choice(same, planted([1 - t for t in top]), CHOICE_PROMPTS, 4)
    assert wrong is not None and wrong["base"] == 0.0 and wrong["auc_base"] == 0.0
    assert wrong["logp_base"] == pytest.approx(float(by_hand.min(1).values.mean()), abs=1e-4)
    vector = 2.0 * adapter.stds() * np.random.default_rng(0).standard_normal(adapter.dim)
    moved = PopulationModels(base, tokenizer, adapter, vector, 3)
    after = forced_choice(moved, planted(top), CHOICE_PROMPTS, 3)
    assert after is not None and after["logp_sft"] == pytest.approx(right["logp_sft"], abs=1e-5)
    assert abs(after["logp_tuned"] - right["logp_tuned"]) > 1e-3
    # A task of many answers, or of one, has no forced choice.
    from essa.types import Example

    many = [Example(p, str(i)) for i, p in enumerate(CHOICE_PROMPTS)]
    assert forced_choice(same, many, CHOICE_PROMPTS, 3) is None
    assert forced_choice(same, planted([0] * len(top)), CHOICE_PROMPTS, 3) is None


def test_forced_choice_of_the_base_and_sft_is_written_before_the_search(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """warm() scores the base's and the SFT adapter's forced choice once and prices the tuned
    model's; the final report then runs the tuned model's forward alone and gives the figures
    of a report that scored every model itself."""
    import essa.drift.report as report_module
    from essa.drift.report import tuned_seconds, warm
    from essa.rewards import get_reward

    base, tokenizer, adapter = svd_setup(tiny_model_dir)
    examples = planted(label_logp(base, tokenizer, CHOICE_PROMPTS).argmax(1).tolist())
    grader = get_reward("math_accuracy")
    monkeypatch.setattr(report_module, "retention_task", lambda source, items: (examples, grader))
    scored: list[tuple[str, ...]] = []  # the models of each log-prob forward

    class Counting(PopulationModels):
        def log_softmax(self, chunk, names=("base", "sft", "tuned")):  # type: ignore[no-untyped-def]
            scored.append(tuple(names))
            return super().log_softmax(chunk, names)

    s = settings(micro_batch_size=5, prompts=0, items=len(examples), samples=0)
    vector = 0.8 * adapter.stds() * np.random.default_rng(0).standard_normal(adapter.dim)
    cache = ContinuationCache()
    warmed = warm(s, Counting(base, tokenizer, adapter, np.zeros(adapter.dim), 5), tokenizer, cache)
    assert scored == [("base",), ("base",), ("sft",), ("sft",)]  # 10 prompts, 5 a forward
    assert warmed["choice_models"] == 2 and warmed["choice"] > 0
    scored.clear()
    final = measure(s, Counting(base, tokenizer, adapter, vector, 5), tokenizer, [], None, None,
                    cache)  # fmt: skip
    assert scored == [("tuned",), ("tuned",)]
    uncached = measure(s, PopulationModels(base, tokenizer, adapter, vector, 5), tokenizer, [],
                       None)  # fmt: skip
    assert final == uncached
    choice = final["retention"]["choice"]
    assert choice["base"] == 1.0 and {"change_from_base", "change_from_sft"} <= set(choice)
    forecast = tuned_seconds(s, warmed, row_seconds=0.0, test_items=10)
    expected = warmed["retention"] / 2 + warmed["choice"] / 2
    assert forecast == pytest.approx(expected, abs=0.06)
