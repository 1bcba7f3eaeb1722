"""Population evaluator: batched, merged and auto give the same completions for the same candidates."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from essa.config import EvaluationConfig, GenerationConfig
from tests.conftest import svd_setup


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    return svd_setup(tiny_model_dir)


PROMPTS = ["12+3=", "7+45=", "1+1=", "99+99="]


def population(adapter, n: int = 4) -> np.ndarray:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, adapter.dim)) * adapter.stds() * 2.0


@pytest.mark.parametrize("micro_batch_size", [3, 1024])
def test_strategies_agree(setup, micro_batch_size: int) -> None:  # type: ignore[no-untyped-def]
    from essa.backends.evaluator import PopulationEvaluator

    model, tokenizer, adapter = setup
    X = population(adapter)
    gen = GenerationConfig(max_new_tokens=6)
    outs = {}
    for strategy in ("batched", "merged", "auto"):
        cfg = EvaluationConfig(strategy=strategy, micro_batch_size=micro_batch_size)
        evaluator = PopulationEvaluator(model, tokenizer, adapter, gen, cfg)
        outs[strategy] = evaluator.completions(X, PROMPTS)
        assert evaluator.stats.sequences == len(X) * len(PROMPTS)
    assert outs["batched"] == outs["merged"] == outs["auto"]
    assert len({tuple(c) for c in outs["batched"]}) > 1, "candidates should differ"


def test_auto_records_choice_and_reuses_it(setup) -> None:  # type: ignore[no-untyped-def]
    from essa.backends.evaluator import PopulationEvaluator

    model, tokenizer, adapter = setup
    evaluator = PopulationEvaluator(
        model,
        tokenizer,
        adapter,
        GenerationConfig(max_new_tokens=4),
        EvaluationConfig(strategy="auto"),
    )
    from essa.backends.evaluator import MAX_PROBES

    # Near a tie (a loaded machine) auto probes again, for at most MAX_PROBES populations.
    for _ in range(MAX_PROBES):
        evaluator.completions(population(adapter), PROMPTS)
        if len(PROMPTS) in evaluator.chosen:
            break
    assert evaluator.chosen[len(PROMPTS)] in ("batched", "merged")
    assert set(evaluator.stats.strategy_seconds) == {"batched", "merged"}
    # The model is left unwrapped and unmerged: the zero vector reproduces the SFT adapter.
    names = {type(m).__name__ for m in model.modules()}
    assert "PopulationLinear" not in names


def test_auto_probes_again_while_strategies_are_close(setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """With equal measured costs `auto` keeps probing (outputs unchanged), then decides."""
    import itertools
    import types

    from essa.backends import evaluator as evaluator_module
    from essa.backends.evaluator import MAX_PROBES, PopulationEvaluator

    model, tokenizer, adapter = setup
    gen = GenerationConfig(max_new_tokens=4)
    X = population(adapter)  # 4 candidates: two per strategy, so per-candidate costs tie
    reference = PopulationEvaluator(
        model, tokenizer, adapter, gen, EvaluationConfig(strategy="batched")
    ).completions(X, PROMPTS)
    # A clock that advances one tick per reading: both halves measure exactly the same cost.
    ticks = itertools.count()
    monkeypatch.setattr(
        evaluator_module, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks)))
    )
    evaluator = PopulationEvaluator(
        model, tokenizer, adapter, gen, EvaluationConfig(strategy="auto")
    )
    for _ in range(MAX_PROBES):
        assert len(PROMPTS) not in evaluator.chosen
        assert evaluator.completions(X, PROMPTS) == reference
    assert evaluator.chosen[len(PROMPTS)] == "batched"  # a tie goes to batched
    assert evaluator.stats.sequences == MAX_PROBES * len(X) * len(PROMPTS)


def test_auto_decides_at_once_when_one_strategy_is_clearly_faster(setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import types

    from essa.backends import evaluator as evaluator_module
    from essa.backends.evaluator import PopulationEvaluator

    model, tokenizer, adapter = setup
    evaluator = PopulationEvaluator(
        model,
        tokenizer,
        adapter,
        GenerationConfig(max_new_tokens=4),
        EvaluationConfig(strategy="auto"),
    )
    slow = {"merged": 0}  # merged calls take 10 clock units longer than batched ones
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    original = evaluator._retrying

    def retrying(strategy, population, prompts, seed):  # type: ignore[no-untyped-def]
        if strategy == "merged":
            now[0] += 10.0
            slow["merged"] += 1
        return original(strategy, population, prompts, seed)

    monkeypatch.setattr(evaluator_module, "time", types.SimpleNamespace(perf_counter=clock))
    monkeypatch.setattr(evaluator, "_retrying", retrying)
    evaluator.completions(population(adapter), PROMPTS)
    assert evaluator.chosen[len(PROMPTS)] == "batched"
    assert slow["merged"] == 2  # the one-row warm-up and one probe: no second population


def test_prompts_are_tokenised_once_per_run(setup) -> None:  # type: ignore[no-untyped-def]
    """Each prompt string goes through the tokenizer once, whatever the population or strategy."""
    from essa.backends.evaluator import PopulationEvaluator

    model, tokenizer, adapter = setup
    seen: list[str] = []

    class Counting:
        def __call__(self, texts, **kwargs):  # type: ignore[no-untyped-def]
            seen.extend(texts)
            return tokenizer(texts, **kwargs)

        def __getattr__(self, name):  # type: ignore[no-untyped-def]
            return getattr(tokenizer, name)

    gen = GenerationConfig(max_new_tokens=3)
    reference = {}
    for strategy in ("batched", "merged"):
        cfg = EvaluationConfig(strategy=strategy)
        reference[strategy] = PopulationEvaluator(model, tokenizer, adapter, gen, cfg).completions(
            population(adapter), PROMPTS
        )
        seen.clear()
        evaluator = PopulationEvaluator(model, Counting(), adapter, gen, cfg)
        assert evaluator.completions(population(adapter), PROMPTS) == reference[strategy]
        evaluator.completions(population(adapter), PROMPTS[::-1] + ["5+5="])
        assert sorted(seen) == sorted(PROMPTS + ["5+5="])


def test_rows_run_shortest_first_with_a_prompts_candidates_together() -> None:
    """Flat indices c * n + i: prompt order by prompt + reference length, candidates inside."""
    from essa.backends.evaluator import length_order

    ids = [[1, 2, 3], [1], [1, 2], [1, 2, 3, 4]]  # n = 4 prompts
    refs = [[9], [9, 9, 9, 9], [9], []]  # lengths 4, 5, 3, 4
    order = length_order(ids, refs, 2).tolist()
    assert order == [2, 6, 0, 4, 3, 7, 1, 5]  # prompt 2, then 0 and 3 (ties keep order), then 1
    assert sorted(order) == list(range(8))
    assert length_order(ids, None, 1).tolist() == [1, 2, 0, 3]
