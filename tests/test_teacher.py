"""Teacher-forced population log-probs (essa.backends.teacher) against one model per candidate."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import svd_setup


def _reference(model, tokenizer, prompt: str, continuation: str) -> list[float]:
    """Plain full-sequence forward of one (prompt, continuation) pair, no padding."""
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    c = tokenizer(continuation, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p + c])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)[0]  # (T, V)
    return [float(logp[len(p) - 1 + t, tok]) for t, tok in enumerate(c)]


def test_population_logprobs_match_each_candidate_merged(tiny_model_dir) -> None:
    from essa.adapters import merged_candidate
    from essa.backends.teacher import population_token_logprobs

    model, tokenizer, adapter = svd_setup(tiny_model_dir)
    rng = np.random.default_rng(0)
    population = rng.normal(0, 0.5, size=(3, adapter.dim)) * adapter.stds()  # (3, D)
    prompts = ["12+3=", "7+7=", "1+1="]
    refs = ["15", "140", "2"]  # different lengths: padding must not leak into scores
    got = population_token_logprobs(
        model, tokenizer, adapter, population, prompts, refs, micro_batch_size=4
    )
    assert len(got) == 3 and [len(x) for x in got[0]] == [2, 3, 1]
    for c, vector in enumerate(population):
        with merged_candidate(model, adapter, vector):
            want = [_reference(model, tokenizer, p, r) for p, r in zip(prompts, refs, strict=True)]
        for g, w in zip(got[c], want, strict=True):
            assert g == pytest.approx(w, abs=2e-5)
    # Candidates differ: the scores are not the base model's for all of them.
    assert got[0] != got[1]


def test_empty_continuation_scores_nothing(tiny_model_dir) -> None:
    from essa.backends.teacher import population_token_logprobs

    model, tokenizer, adapter = svd_setup(tiny_model_dir)
    out = population_token_logprobs(
        model,
        tokenizer,
        adapter,
        np.zeros((2, adapter.dim)),
        ["1+1=", "2+2="],
        ["", "4"],
        micro_batch_size=3,
    )
    assert out[0][0] == [] and len(out[1][1]) == 1


@pytest.mark.parametrize(
    ("strategy", "shared_prefix", "temperature", "drop_rows"),
    [  # each value twice; each strategy with and without each of the other switches
        ("batched", True, 0.0, True),
        ("merged", False, 0.8, True),
        ("batched", False, 0.8, False),
        ("merged", True, 0.0, False),
    ],
)
def test_references_forced_in_the_prefill_match_a_separate_pass(
    tiny_model_dir, monkeypatch, strategy: str, shared_prefix: bool, temperature: float,
    drop_rows: bool,
) -> None:  # fmt: skip
    """The tie-breaker's reference log-probs come from the generation's own prefill (or, where
    the decode loop does not apply, a forward of their own): they equal the separate teacher-
    forced pass, and the completions are those of a call without them."""
    import essa.backends.generate as hf
    from essa.backends.decode import supports_row_dropping
    from essa.backends.evaluator import PopulationEvaluator
    from essa.config import EvaluationConfig, GenerationConfig

    model, tokenizer, adapter = svd_setup(tiny_model_dir)
    assert supports_row_dropping(model)  # the prefill path is the one under test
    if not drop_rows:
        monkeypatch.setattr(hf, "supports_row_dropping", lambda _model: False)
    rng = np.random.default_rng(3)
    population = rng.normal(0, 0.5, size=(3, adapter.dim)) * adapter.stds()  # (3, D)
    head = "Please add these two numbers: " if shared_prefix else ""
    prompts = [f"{head}{q}" for q in ("12+3=", "7+7=", "1+1=", "40+2=")]
    refs = ["15", "14", None, "42"]  # a missing reference scores nothing
    gen = GenerationConfig(max_new_tokens=5, temperature=temperature)
    cfg = EvaluationConfig(strategy=strategy, micro_batch_size=5, use_prefix_cache=True)
    evaluator = PopulationEvaluator(model, tokenizer, adapter, gen, cfg)
    plain = evaluator.completions(population, prompts, seed=7, samples=2)
    forced = evaluator.completions(population, prompts, seed=7, samples=2, references=refs)
    assert forced == plain
    got = evaluator.last_reference_logprobs
    expanded = [p for p in prompts for _ in range(2)]
    want = evaluator.reference_logprobs(
        population, expanded, [r or "" for r in refs for _ in range(2)]
    )
    assert [len(x) for x in got[0]] == [2, 2, 2, 2, 0, 0, 2, 2]
    for g_c, w_c in zip(got, want, strict=True):
        for g, w in zip(g_c, w_c, strict=True):
            assert g == pytest.approx(w, abs=2e-5)
    assert got[0] != got[1]  # per candidate, not the base model's


def test_reference_term_and_signal_metrics_by_hand() -> None:
    from essa.es.generation import reference_term, signal_metrics

    dense = reference_term([[[-1.0, -3.0], [-2.0]], [[-0.5, -0.5], []], [[], []]])
    assert dense[:2].tolist() == [-2.0, -0.5] and np.isnan(dense[2])
    m = signal_metrics(np.array([0.5, 0.25, np.nan, 0.75]), 32)
    # best 0.75, mean 0.5 -> 8 prompts; population std of (0.5, 0.25, 0.75) = 0.2041 -> 6.53
    assert m["margin_prompts"] == pytest.approx(8.0)
    assert m["spread_prompts"] == pytest.approx(np.std([0.5, 0.25, 0.75]) * 32)


def test_reward_is_flat_follows_hansens_rule_by_hand() -> None:
    from essa.es.generation import reward_is_flat

    # P = 10: flat when the best equals the ceil(0.7 * 10) = 7th best.
    assert reward_is_flat(np.array([0.5] * 7 + [0.0] * 3))
    assert not reward_is_flat(np.array([0.75] + [0.5] * 6 + [0.0] * 3))  # one stands out
    assert not reward_is_flat(np.array([0.5] * 6 + [0.0] * 4))  # only 6 share the top
    assert reward_is_flat(np.array([0.3, 0.1 + 0.2] + [0.3] * 5 + [np.nan] * 3))  # last-bit tie
    assert not reward_is_flat(np.array([0.5] * 4 + [np.nan] * 6))  # failures rank worst


def test_tell_widens_sigma_only_when_switched_on_and_the_reward_is_flat() -> None:
    from essa.config import load_config
    from essa.es.optimizer import tell
    from essa.optimizers.cma_es import CMAES

    on = load_config(None, ["optimizer.escape_flat_reward=true"])
    off = load_config(None, [])
    fitness = -np.arange(8.0)  # ranked by the tie-breaker alone in the flat case
    sigmas = {}
    for name, cfg, pool in (
        ("on-flat", on, {"reward_flat": 1.0}),
        ("on-ranked", on, {"reward_flat": 0.0}),
        ("off-flat", off, {"reward_flat": 1.0}),
    ):
        opt = CMAES(6, population_size=8, sigma0=0.3, seed=0)
        metrics = tell(cfg.optimizer, opt, opt.ask(), fitness, pool)
        sigmas[name] = (opt.sigma, metrics["sigma_widened"], opt.flat_factor())
    assert sigmas["on-ranked"][1] == sigmas["off-flat"][1] == 0.0
    assert sigmas["on-ranked"][0] == sigmas["off-flat"][0]
    assert sigmas["on-flat"][1] == 1.0
    assert sigmas["on-flat"][0] == pytest.approx(sigmas["off-flat"][0] * sigmas["on-flat"][2])


def _margins(model, tokenizer, prompt: str, continuation: str) -> list[float]:
    """log p(y_t) - max_v log p(v) per continuation token, from one plain forward."""
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    c = tokenizer(continuation, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([p + c])).logits.float()
    logp = torch.log_softmax(logits, dim=-1)[0]  # (T, V)
    rows = [logp[len(p) - 1 + t] for t in range(len(c))]
    return [float(row[tok] - row.max()) for row, tok in zip(rows, c, strict=True)]


@pytest.mark.parametrize("drop_rows", [True, False])
def test_reference_margins_in_the_prefill_match_each_candidate_merged(
    tiny_model_dir, monkeypatch, drop_rows: bool
) -> None:
    """reward.reference_signal: margin, from the decode loop's prefill or (where that loop does
    not apply) the separate teacher pass: each candidate's margins as its own merged model
    gives them, and the completions unchanged."""
    import essa.backends.generate as hf
    from essa.adapters import merged_candidate
    from essa.backends.evaluator import PopulationEvaluator
    from essa.config import EvaluationConfig, GenerationConfig

    model, tokenizer, adapter = svd_setup(tiny_model_dir)
    if not drop_rows:
        monkeypatch.setattr(hf, "supports_row_dropping", lambda _model: False)
    population = np.random.default_rng(5).normal(0, 0.5, size=(2, adapter.dim)) * adapter.stds()
    prompts, refs = ["12+3=", "7+7=", "40+2="], ["15", "140", "42"]
    cfg = EvaluationConfig(strategy="batched", micro_batch_size=4)
    evaluator = PopulationEvaluator(
        model, tokenizer, adapter, GenerationConfig(max_new_tokens=4), cfg
    )
    plain = evaluator.completions(population, prompts)
    evaluator.reference_margin = True
    assert evaluator.completions(population, prompts, references=refs) == plain
    got = evaluator.last_reference_logprobs  # [candidate][item][token]: margins
    for c, vector in enumerate(population):
        with merged_candidate(model, adapter, vector):
            want = [_margins(model, tokenizer, p, r) for p, r in zip(prompts, refs, strict=True)]
        for g, w in zip(got[c], want, strict=True):
            assert g == pytest.approx(w, abs=2e-5)
    assert all(v <= 0 for c in got for item in c for v in item)
    assert any(v < -1e-3 for c in got for item in c for v in item)  # not all greedy's choice


def test_margin_needs_the_tie_breaker() -> None:
    from essa.config import ConfigError, load_config

    with pytest.raises(
        ConfigError, match="reward.reference_signal: margin .* needs reward.reference_weight > 0"
    ):
        load_config(None, ["reward.reference_signal=margin"])
    cfg = load_config(None, ["reward.reference_signal=margin", "reward.reference_weight=1"])
    assert cfg.reward.reference_signal == "margin"


@pytest.mark.slow
def test_a_run_with_margins_logs_them(tmp_path) -> None:
    import json

    from tests.test_train_e2e import essa, sets

    run_dir = tmp_path / "run"
    res = essa("train", "--run-dir", str(run_dir), *sets(
        "sft.steps=6", "data.sft_size=16", "data.test_size=16", "data.batch_size=8",
        "optimizer.population_size=4", "evaluation.every=0", "run.generations=2",
        "run.show_progress=false", "evaluation.drift.items=0", "reward.reference_weight=1",
        "reward.reference_signal=margin",
        "reward.reference_check=false",  # the check may drop the term these records hold
    ))  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines if '"reference_margin"' in x]
    assert len(records) == 2 and all(r["reference_margin"] <= 0 for r in records)
    assert not any('"reference_logprob"' in x for x in lines)
