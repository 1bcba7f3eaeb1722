"""Label-free and log-prob rewards through the ESSA population.

Common random numbers on the HF evaluator, the generated tokens' log-probs, and end-to-end
runs with TTRL's vote (within a candidate's samples, or over the whole population), RLSC
self-confidence and the reference log-likelihood, including 1-rank vs 2-rank parity.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.cli_runner import essa
from tests.conftest import svd_setup
from tests.test_mpi import assert_same_adapter, generations, needs_mpi, small, train, trajectory

PROMPTS = ["12+34=", "5+5=", "71+8=", "9+13="]


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    return svd_setup(tiny_model_dir)


def _evaluator(setup, strategy: str = "batched", temperature: float = 0.9):  # type: ignore[no-untyped-def]
    from essa.backends.evaluator import PopulationEvaluator
    from essa.config import EvaluationConfig, GenerationConfig

    model, tokenizer, adapter = setup
    gen = GenerationConfig(max_new_tokens=6, temperature=temperature, top_p=0.95)
    return PopulationEvaluator(model, tokenizer, adapter, gen, EvaluationConfig(strategy=strategy))


def test_identical_candidates_draw_identical_samples(setup) -> None:  # type: ignore[no-untyped-def]
    _, _, adapter = setup
    rng = np.random.default_rng(0)
    a, b = (rng.normal(0, 0.5, adapter.dim) * adapter.stds() for _ in range(2))
    evaluator = _evaluator(setup)
    texts = evaluator.completions(np.stack([a, b, a]), PROMPTS, seed=11, samples=3)
    assert len(texts) == 3 and len(texts[0]) == len(PROMPTS) * 3
    assert texts[0] == texts[2]  # same parameters, same streams: the same samples
    assert texts[0] != texts[1]
    # The k samples of a prompt differ (their own streams), so a vote among them means something.
    assert any(len(set(texts[0][i * 3 : i * 3 + 3])) > 1 for i in range(len(PROMPTS)))
    # A candidate's samples do not depend on its position, on its neighbours or on the strategy.
    alone = evaluator.completions(b[None, :], PROMPTS, seed=11, samples=3)
    swapped = _evaluator(setup, "merged").completions(np.stack([b, a]), PROMPTS, seed=11, samples=3)
    assert alone[0] == texts[1] == swapped[0] and swapped[1] == texts[0]
    # Another seed draws other samples.
    assert evaluator.completions(a[None, :], PROMPTS, seed=12, samples=3)[0] != texts[0]


def test_generated_logprobs_match_teacher_forcing(setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from essa.backends.teacher import population_token_logprobs

    model, tokenizer, adapter = setup
    population = np.random.default_rng(1).normal(0, 0.5, (2, adapter.dim)) * adapter.stds()
    # A random model also emits <pad>, <unk>, spaces and ids beyond the tokenizer's 18, which
    # do not survive decoding and re-tokenising; suppress them (a generation-config processor,
    # as a real model's config would have) so that the text's tokens are the generated ones.
    hidden = [0, 2, 17, *range(18, model.config.vocab_size)]
    monkeypatch.setattr(model.generation_config, "suppress_tokens", hidden, raising=False)
    for temperature in (0.0, 0.9):
        evaluator = _evaluator(setup, temperature=temperature)
        evaluator.record_logprobs = True
        texts = evaluator.completions(population, PROMPTS, seed=3)
        forced = population_token_logprobs(
            model, tokenizer, adapter, population, PROMPTS, [t for t in texts[0]] * 1,
            micro_batch_size=8,
        )  # fmt: skip
        got = evaluator.last_logprobs
        assert [len(x) for x in got] == [len(PROMPTS)] * 2
        compared = 0
        for item, text in enumerate(texts[0]):
            n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            # One log-prob per generated token: the text's own, plus the stop token if any
            # (a random model may stop at once: an empty text with the stop token's alone).
            assert len(got[0][item]) in (n, n + 1)
            if n:
                assert got[0][item][:n] == pytest.approx(forced[0][item], abs=1e-4)
                compared += 1
        assert compared > 0  # at least one completion's tokens were checked


def test_reference_logprobs_on_the_evaluator(setup) -> None:  # type: ignore[no-untyped-def]
    _, _, adapter = setup
    evaluator = _evaluator(setup, temperature=0.0)
    out = evaluator.reference_logprobs(np.zeros((2, adapter.dim)), PROMPTS[:2], ["46", "10"])
    assert [len(x) for x in out[0]] == [2, 2] and out[0] == out[1]
    assert all(v <= 0 for v in out[0][0])


def _run(tiny_model_dir: Path, run_dir: Path, ranks: int, *sets: str) -> dict:
    train(ranks, "--run-dir", str(run_dir), sets=small(tiny_model_dir, *sets))
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def one_process(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[tuple[str, ...]], Path]:
    """The one-process 2-generation run of some overrides, run once per overrides: the
    end-to-end test and the two-rank test of the same reward read the same run."""
    runs: dict[tuple[str, ...], Path] = {}

    def run(sets: tuple[str, ...]) -> Path:
        if sets not in runs:
            run_dir = tmp_path_factory.mktemp("one-process") / "run"
            _run(tiny_model_dir, run_dir, 0, "run.generations=2", *sets)
            runs[sets] = run_dir
        return runs[sets]

    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    "sets",
    [
        ("reward.name=majority_vote", "reward.params.pool=population"),
        (
            "reward.name=majority_vote",
            "generation.samples_per_prompt=2",
            "generation.temperature=0.8",
        ),
        ("reward.name=self_confidence",),
        ("reward.name=reference_logprob",),
        ("reward.reference_weight=0.5", "optimizer.escape_flat_reward=true"),
    ],
    ids=["pool-population", "k-samples", "self-confidence", "reference-logprob", "tie-breaker"],
)
def test_label_free_and_logprob_rewards_train_end_to_end(
    one_process: Callable[[tuple[str, ...]], Path], sets: tuple[str, ...]
) -> None:
    run_dir = one_process(sets)
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [r for r in generations(run_dir) if r["generation"] >= 0]
    assert len(records) == 2
    assert all(r["n_failed"] == 0 and r["mean_fitness"] is not None for r in records)
    # Held-out is scored with the true answers whatever the training reward.
    assert summary["heldout_metric"] == "math_accuracy"
    if "reward.params.pool=population" in sets:
        assert all(0 < r["majority_share"] <= 1 for r in records)
    # Every generation says how far its best candidate stands above the mean, in prompts.
    assert all(r["margin_prompts"] >= 0 and r["spread_prompts"] >= 0 for r in records)
    if "reward.reference_weight=0.5" in sets:
        assert all(r["reference_logprob"] < 0 for r in records)
        # The fitness is the reward plus the weighted log-likelihood: below the reward alone.
        assert all(r["mean_fitness"] < 1 + 0.5 * r["reference_logprob"] + 1e-9 for r in records)
        # Under escape_flat_reward, sigma widens exactly on the generations the reward was flat.
        assert all(r["sigma_widened"] == r["reward_flat"] for r in records)


def test_group_reward_without_groups_is_one_clear_line(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    sets = small(tiny_model_dir, "reward.name=majority_vote")
    res = essa("train", "--run-dir", str(tmp_path / "r"), *[a for s in sets for a in ("--set", s)])
    assert res.returncode == 2
    assert "samples_per_prompt >= 2" in res.stderr and "pool: population" in res.stderr
    assert "Traceback" not in res.stderr


def test_vote_group_no_vote_reaches_is_one_clear_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    """16 candidates x 1 sample: a population vote of at least 17 completions never happens."""
    sets = small(
        tiny_model_dir,
        "reward.name=majority_vote",
        "reward.params.pool=population",
        "reward.params.min_group_size=17",
        "optimizer.population_size=16",
    )
    res = essa("train", "--run-dir", str(tmp_path / "r"), *[a for s in sets for a in ("--set", s)])
    assert res.returncode == 2, res.stderr[-2000:]
    assert "reward.params.min_group_size: 17 is more than the 16 completions" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "r" / "metrics.jsonl").exists()  # refused before any generation


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize(
    "sets",
    [
        ("reward.name=majority_vote", "reward.params.pool=population"),
        (
            "reward.name=majority_vote",
            "reward.params.pool=population",
            "generation.samples_per_prompt=2",
            "generation.temperature=0.8",
        ),
        ("reward.reference_weight=0.5",),
    ],
    ids=["greedy-pool", "sampled-pool", "tie-breaker"],
)
def test_population_pool_two_ranks_match_one_rank(
    tiny_model_dir: Path,
    tmp_path: Path,
    one_process: Callable[[tuple[str, ...]], Path],
    sets: tuple[str, ...],
) -> None:
    one = one_process(sets)  # greedy-pool: the end-to-end test's pool-population run
    two = tmp_path / "two"
    _run(tiny_model_dir, two, 2, "run.generations=2", *sets)
    assert trajectory(two) == trajectory(one)  # fitness, majority share, held-out, ...
    assert_same_adapter(two, one)
    # Rank 0 receives the other rank's answer keys (8 bytes each) besides fitness and checks;
    # with the tie-breaker, instead, two more (P,) float gathers (the fitness with the term,
    # the term alone): each the other rank's 2 candidates x 8 bytes plus an 8-byte count,
    # and the per-prompt fitness the signal reads (2 candidates x 4 prompts, plus a count).
    k = 2 if "generation.samples_per_prompt=2" in sets else 1
    pooled = "reward.params.pool=population" in sets
    # Always: the other rank's 2 candidates' rewards on the 4 prompts (the signal's), 8 bytes
    # each plus a count.
    ranked = 8 * 2 * 4 + 8
    expected = 96 + 72 + (8 * (2 * 4 * k) + 8 if pooled else 2 * (8 + 8 * 2) + ranked)
    for record in generations(two)[1:]:
        assert record["comm_bytes"] == expected


def test_heldout_decoding_is_greedy_under_a_sampling_config(setup) -> None:  # type: ignore[no-untyped-def]
    """Training may sample (temperature > 0); the held-out score always decodes greedily."""
    from essa.es.generation import heldout_texts

    _, _, adapter = setup
    vector = np.random.default_rng(4).normal(0, 0.5, adapter.dim) * adapter.stds()
    sampling = _evaluator(setup, temperature=0.9)
    want = _evaluator(setup, temperature=0.0).completions(vector[None, :], PROMPTS * 3)[0]
    assert heldout_texts(sampling, vector, PROMPTS * 3) == want
    assert sampling.gen.temperature == 0.9  # restored for the next generation
    sampled = sampling.completions(vector[None, :], PROMPTS * 3, seed=1)[0]
    assert sampled != want  # the config does sample: the check above is not vacuous
