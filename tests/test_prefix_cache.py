"""Shared-prefix KV cache: the same completions and first-step logits as encoding every row whole."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from essa.config import EvaluationConfig, GenerationConfig
from tests.conftest import svd_setup

SYSTEM = "1234567890+9876543210="  # 22 shared tokens (this tokenizer drops spaces)
PROMPTS = [SYSTEM + q for q in ("12+3=", "7+45=", "1+1=", "99+99=", "5*6=")]


@pytest.fixture(scope="module", autouse=True)
def one_thread():  # type: ignore[no-untyped-def]
    # The model is tiny: a second intra-op thread only adds synchronisation, which costs seconds
    # per generate call when other work keeps the cores busy.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    base, tokenizer, adapter = svd_setup(tiny_model_dir)
    X = np.random.default_rng(0).normal(size=(4, adapter.dim)) * adapter.stds() * 2.0
    return base, tokenizer, adapter, X


def evaluate(setup, strategy: str, micro_batch_size: int, use_prefix_cache: bool, prompts):  # type: ignore[no-untyped-def]
    from essa.backends.evaluator import PopulationEvaluator

    model, tokenizer, adapter, X = setup
    cfg = EvaluationConfig(
        strategy=strategy, micro_batch_size=micro_batch_size, use_prefix_cache=use_prefix_cache
    )
    evaluator = PopulationEvaluator(
        model, tokenizer, adapter, GenerationConfig(max_new_tokens=6), cfg
    )
    return evaluator.completions(X, prompts)


@pytest.mark.parametrize("micro_batch_size", [3, 1024])
@pytest.mark.parametrize("strategy", ["batched", "merged"])
def test_cached_completions_match(setup, strategy, micro_batch_size, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from essa.backends import generate as hf

    calls = []
    original = hf.prefix_states

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(hf, "prefix_states", spy)
    cached = evaluate(setup, strategy, micro_batch_size, True, PROMPTS)
    monkeypatch.undo()
    whole = evaluate(setup, strategy, micro_batch_size, False, PROMPTS)
    assert cached == whole
    assert len({tuple(c) for c in cached}) > 1, "candidates should differ"
    # One prefix pass per call: the batched call covers all candidates, merged one per candidate.
    assert len(calls) == (1 if strategy == "batched" else len(setup[3]))
    assert all(len(prefix) == len(SYSTEM) for prefix in calls)


@pytest.mark.parametrize("strategy", ["batched", "merged"])
def test_first_step_logits_match(setup, strategy: str) -> None:  # type: ignore[no-untyped-def]
    from essa.adapters import PopulationLoRA, candidate_rows, merged_candidate
    from essa.backends.generate import (
        _cache_argument,
        pad_rows,
        prefix_states,
        shared_prefix_length,
    )

    model, tokenizer, adapter, X = setup
    encoded = tokenizer(PROMPTS, add_special_tokens=False)["input_ids"]
    prefix_len = shared_prefix_length(encoded)
    assert prefix_len == len(SYSTEM)
    kwargs = dict(
        max_new_tokens=1,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        pad_token_id=0,
        eos_token_id=1,
    )

    def first_logits(rows, set_rows):  # type: ignore[no-untyped-def]
        # prefix_states runs the prefix in chunks of 3 candidates: 4 candidates take two.
        prefix = prefix_states(model, encoded[0][:prefix_len], rows, 3, set_rows)
        if set_rows is not None:
            set_rows(rows)
        ids, mask = pad_rows(encoded * (len(rows) // len(PROMPTS)), prefix_len, 0, cpu)
        cache = {_cache_argument(model): prefix.expand(model, rows)}
        cached = model.generate(input_ids=ids, attention_mask=mask, **cache, **kwargs)
        ids, mask = pad_rows(encoded * (len(rows) // len(PROMPTS)), 0, 0, cpu)  # left padding
        whole = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        return cached.logits[0], whole.logits[0]  # (B, V) each

    cpu = torch.device("cpu")
    with torch.no_grad():
        if strategy == "batched":
            with PopulationLoRA(model, adapter) as pop:
                pop.set_population(X)
                cached, whole = first_logits(candidate_rows(len(X), len(PROMPTS)), pop.set_rows)
        else:
            with merged_candidate(model, adapter, X[1]):
                cached, whole = first_logits(torch.zeros(len(PROMPTS), dtype=torch.long), None)
    assert cached.shape == whole.shape
    torch.testing.assert_close(cached, whole, atol=1e-5, rtol=0)


def test_short_prefix_falls_back(setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from essa.backends import generate as hf

    prompts = ["12=" + q for q in ("12+3=", "7+45=")]  # 3 shared tokens < MIN_PREFIX_TOKENS

    def fail(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("prefix cache used below MIN_PREFIX_TOKENS")

    monkeypatch.setattr(hf, "prefix_states", fail)
    short = evaluate(setup, "batched", 1024, True, prompts)
    monkeypatch.undo()
    assert short == evaluate(setup, "batched", 1024, False, prompts)


def test_shared_prefix_length() -> None:
    from essa.backends.generate import shared_prefix_length

    assert shared_prefix_length([[1, 2, 3, 4], [1, 2, 5]]) == 2
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3]]) == 2  # each keeps one own token
    assert shared_prefix_length([[7], [7, 8]]) == 0
    assert shared_prefix_length([[1, 2, 3]]) == 2
    assert shared_prefix_length([]) == 0
