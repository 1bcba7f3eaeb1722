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
