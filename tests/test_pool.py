"""The population vote pool (essa.rewards.pool): keys, majority, agreement, and MPI parity."""

from __future__ import annotations

import json

import numpy as np
import pytest

from essa.rewards.pool import (
    NO_ANSWER,
    agreement_rewards,
    answer_key,
    answer_keys,
    canonical_answer,
    majority_share,
    population_majority,
)
from tests.test_mpi import TESTS, launch, needs_mpi


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("2", "2.0"),
        ("\\boxed{0.5}", "\\boxed{1/2}"),
        ("so \\boxed{\\frac{3}{6}}", "0.50"),
        ("-3", "-3.00"),
    ],
)
def test_equal_answers_share_a_key(a: str, b: str) -> None:
    assert answer_key(a) == answer_key(b) != NO_ANSWER


def test_different_answers_and_missing_ones() -> None:
    assert answer_key("2") != answer_key("3")
    assert answer_key("no digits") == NO_ANSWER
    assert canonical_answer("x + 1") == "x+1"  # non-numeric text: whitespace-free string


def test_key_is_stable_across_processes() -> None:
    # BLAKE2b of the canonical answer, not Python's per-process salted hash().
    import hashlib

    digest = hashlib.blake2b(b"42", digest_size=8).digest()
    assert answer_key("the answer is 42") == int.from_bytes(digest, "little", signed=True)


def test_majority_counts_votes_across_candidates_and_samples() -> None:
    keys = np.array([[1, 2, 3, 3], [2, 2, 3, 0], [1, 1, 0, 0]])  # (P=3, M=4)
    # Two prompts with two samples each: prompt 0 is columns 0-1, prompt 1 columns 2-3.
    majority = population_majority(keys, [[0, 1], [2, 3]])
    # Prompt 0 votes 1,2 | 2,2 | 1,1: a 3-3 tie, the smaller key 1; prompt 1: key 3 (3 votes).
    assert majority.tolist() == [1, 3]
    keys[2, 0] = 2  # now 2 has 4 votes
    assert population_majority(keys, [[0, 1], [2, 3]]).tolist() == [2, 3]


def test_majority_tie_goes_to_the_smaller_key_whatever_the_order() -> None:
    keys = np.array([[7], [9], [9], [7]])
    assert population_majority(keys, [[0]]).tolist() == [7]
    assert population_majority(np.array([[9], [7], [7], [9]]), [[0]]).tolist() == [7]
    assert population_majority(np.array([[-9], [7], [-9], [7]]), [[0]]).tolist() == [-9]


def test_missing_answers_do_not_vote_and_score_zero() -> None:
    keys = np.array([[0, 5], [0, 0], [4, 0]])
    majority = population_majority(keys, [[0], [1]])
    assert majority.tolist() == [4, 5]
    all_missing = population_majority(np.zeros((3, 1), dtype=np.int64), [[0]])
    assert all_missing.tolist() == [NO_ANSWER]
    rewards = agreement_rewards(np.zeros((3, 1), dtype=np.int64), all_missing, [[0]])
    assert rewards.tolist() == [[0.0], [0.0], [0.0]]  # agreeing on "nothing" earns nothing


def test_agreement_rewards_and_share() -> None:
    texts = [["4", "7"], ["4.0", "8"], ["5", "8"]]
    keys = answer_keys(texts)
    majority = population_majority(keys, [[0], [1]])
    rewards = agreement_rewards(keys, majority, [[0], [1]])
    assert rewards.tolist() == [[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]]
    assert majority_share(keys, majority, [[0], [1]]) == pytest.approx(4 / 6)
    # A shard of the population scores the same as its rows of the whole.
    assert agreement_rewards(keys[1:], majority, [[0], [1]]).tolist() == rewards[1:].tolist()


def _local_pool() -> list[list[float]]:
    from mpi_helpers import POOL_TEXTS

    keys = answer_keys(POOL_TEXTS)
    groups = [[0], [1], [2]]
    return agreement_rewards(keys, population_majority(keys, groups), groups).tolist()


def test_pool_vote_of_the_fixture() -> None:
    # 4 vs 5 vs 4.0 -> "4"; 7, 8, 8, 7, 9 -> tie 7/8, the smaller key; 1/2 x3 vs x -> 1/2.
    assert _local_pool() == [
        [1.0, 1.0, 0.0],
        [1.0, 0.0, 0.0],
        [0.0, 0.0, 1.0],
        [1.0, 1.0, 1.0],
        [0.0, 0.0, 1.0],
    ]


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_pool_vote_is_rank_count_independent(ranks: int, tmp_path) -> None:
    res, _ = launch(ranks, str(TESTS / "mpi_helpers.py"), "pool", str(tmp_path), timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]
    assert len(lines) == ranks
    gathered = [row for line in lines for row in line["rewards"]]
    assert gathered == _local_pool()
    # Only 8-byte keys crossed ranks: per rank, (5 - own rows) x 3 keys plus the size counts.
    for line, own in zip(lines, [len(r["rewards"]) for r in lines], strict=True):
        assert line["bytes"] == 8 * (5 - own) * 3 + 8 * (ranks - 1)
