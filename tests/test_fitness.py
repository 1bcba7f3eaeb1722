"""ES fitness from rewards over k samples per prompt (essa.rewards.fitness)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from essa.dist import LocalComm
from essa.rewards import get_reward
from essa.rewards.fitness import candidate_scores, expand, fitness, sample_groups


def test_layout_helpers() -> None:
    assert expand(["a", "b"], 3) == ["a", "a", "a", "b", "b", "b"]
    assert sample_groups(2, 2) == [[0, 1], [2, 3]]


def test_plain_reward_scores_every_sample() -> None:
    reward = get_reward("math_accuracy")
    texts = [["4", "5", "9", "9"], ["3", "3", "9", "1"]]  # 2 candidates x (2 prompts x 2)
    scores, metrics = candidate_scores(
        reward, texts, ["4", "9"], ["2+2=", "4+5="], samples_per_prompt=2
    )
    assert scores == [[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]]
    assert fitness(scores).tolist() == [0.75, 0.25] and metrics == {}


def test_group_reward_votes_within_each_candidates_samples() -> None:
    # TTRL within one policy: candidate 0's samples of prompt 0 vote 7,7,8 -> 7 wins.
    reward = get_reward("majority_vote")
    texts = [["7", "7", "8"], ["8", "1", "8"]]
    scores, _ = candidate_scores(reward, texts, [None], ["q"], samples_per_prompt=3)
    assert scores == [[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]]


def test_group_reward_with_one_sample_is_not_gradable() -> None:
    reward = get_reward("majority_vote")
    scores, _ = candidate_scores(reward, [["7"], ["8"]], [None], ["q"], samples_per_prompt=1)
    assert scores == [[None], [None]]
    assert all(math.isnan(f) for f in fitness(scores))  # a failed evaluation, not a zero


def test_population_pool_votes_across_candidates() -> None:
    reward = get_reward("majority_vote", pool="population")
    texts = [["7", "2"], ["7", "3"], ["8", "3"]]  # 3 candidates, 2 prompts, k = 1
    scores, metrics = candidate_scores(reward, texts, [None, None], ["a", "b"], comm=LocalComm())
    assert scores == [[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]]
    assert metrics["majority_share"] == pytest.approx(4 / 6)
    assert "majority_correct_share" not in metrics  # no labels: nothing to check the vote on
    # With labels (hidden from the reward) the vote's accuracy is logged: 7 right, 3 wrong.
    labelled, metrics = candidate_scores(reward, texts, ["7", "2"], ["a", "b"], comm=LocalComm())
    assert labelled == scores and metrics["majority_correct_share"] == 0.5
    with pytest.raises(ValueError, match="communicator"):
        candidate_scores(reward, texts, [None, None], ["a", "b"])


def test_population_pool_honours_use_last_number() -> None:
    # Without the last-number fallback the bare "7"s cast no vote, so the boxed 8 wins.
    texts = [["7"], ["7"], [r"\boxed{8}"]]
    pooled, _ = candidate_scores(
        get_reward("majority_vote", pool="population"), texts, [None], ["q"], comm=LocalComm()
    )
    assert pooled == [[1.0], [1.0], [0.0]]
    strict = get_reward("majority_vote", pool="population", use_last_number=False)
    scores, metrics = candidate_scores(strict, texts, [None], ["q"], comm=LocalComm())
    assert scores == [[0.0], [0.0], [1.0]] and metrics["answered_share"] == pytest.approx(1 / 3)


def test_population_pool_honours_min_group_size() -> None:
    # The group of a prompt is all candidates' k completions: 3 candidates x 2 samples = 6.
    texts = [["7", "7"], ["7", "8"], ["8", "7"]]
    for size, gradable in [(6, True), (7, False)]:
        reward = get_reward("majority_vote", pool="population", min_group_size=size)
        scores, _ = candidate_scores(
            reward, texts, [None], ["q"], samples_per_prompt=2, comm=LocalComm()
        )
        expected = [[1.0, 1.0], [1.0, 0.0], [0.0, 1.0]] if gradable else [[None, None]] * 3
        assert scores == expected


def test_logprob_reward_takes_backend_logprobs() -> None:
    reward = get_reward("self_confidence", use_length_norm=False)
    logprobs = [[[math.log(0.5)], [math.log(0.25)]], [[0.0], []]]
    scores, _ = candidate_scores(
        reward, [["a", "b"], ["c", ""]], [None, None], ["p", "q"], logprobs=logprobs
    )
    assert scores == [[0.5, 0.25], [1.0, None]]
    with pytest.raises(ValueError, match="log-probs"):
        candidate_scores(reward, [["a"]], [None], ["p"])


def test_fitness_is_independent_of_the_candidates_position() -> None:
    reward = get_reward("majority_vote", pool="population")
    texts = [["7", "2"], ["7", "3"], ["8", "3"]]
    ordered, _ = candidate_scores(reward, texts, [None, None], ["a", "b"], comm=LocalComm())
    swapped, _ = candidate_scores(
        reward, [texts[1], texts[0], texts[2]], [None, None], ["a", "b"], comm=LocalComm()
    )
    assert np.array_equal(fitness(ordered)[[1, 0, 2]], fitness(swapped))
