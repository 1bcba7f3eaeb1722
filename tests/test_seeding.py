"""Random streams: one domain each, and draws that depend on where they happen, not on when.

The random rewards (``random``, ``noisy``) draw at each item's place in the run, so a candidate
scores the same on one rank or two, wherever it sits in its rank's shard, and after a resume.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import numpy as np
import pytest

import essa.optimizers  # noqa: F401  (registers the ES optimizers' own streams in seeding)
from essa import seeding
from tests.test_mpi import assert_same_adapter, needs_mpi, small, train, trajectory

# Keys each domain takes (its arity); the seeding module promises a fixed arity per run.
ARITY = {
    "cma_es.samples": 0,
    "sft.batches": 0,
    "es.minibatch": 1,
    "es.scale_baseline": 0,
    "layerwise.schedule": 1,
    "layerwise.block_seed": 1,
    "data.test_split": 0,
    "data.sft_split": 0,
    "grpo.prompts": 2,
    "grpo.sampling": 2,
    "grpo.replay": 2,
    "dpo.prompts": 1,
    "dpo.sampling": 1,
    "scalebio.batches": 2,
    "selection.refill": 1,
    "dpo.file_pairs": 1,
    "openai_es.noise": 2,
    "snes.samples": 1,
    "cure.critical": 0,
    "cure.branches": 0,
    "reward.random": 6,  # an ESSA item's draw key: (seed, site, generation, prompt, cand., sample)
    "reward.noisy": 5,  # an ESSA group's key: the item's without the sample
    "drift.samples": 0,
    "tools.turn": 1,
    "es.signal": 1,
}


def test_every_domain_has_its_own_tag_and_a_declared_arity() -> None:
    assert len(set(seeding.DOMAINS.values())) == len(seeding.DOMAINS)
    assert set(ARITY) == set(seeding.DOMAINS)


def test_no_two_streams_coincide() -> None:
    """Every (domain, keys) on a small grid of seeds and keys gives its own stream."""
    seen: dict[tuple[int, ...], tuple[object, ...]] = {}
    for domain, arity in ARITY.items():
        for seed in (0, 1, 5):
            for keys in itertools.product(range(4), repeat=min(arity, 3)):
                keys = keys + (0,) * (arity - len(keys))
                state = tuple(seeding.seed_sequence(seed, domain, *keys).generate_state(4))
                assert state not in seen, (domain, seed, keys, seen.get(state))
                seen[state] = (domain, seed, keys)


def test_openai_es_noise_is_not_another_stream() -> None:
    """Its noise was SeedSequence([seed, g, i]): generation 2 drew the mini-batch stream of
    generation i, generation 5 the layer schedule's, generation 0 pair 0 CMA-ES's own."""
    from essa.optimizers.openai_es import pair_noise

    for g, legacy_tag in ((2, 2), (5, 5)):
        noise = pair_noise(3, g, 4, 6)
        for i in range(4):
            other = np.random.default_rng(np.random.SeedSequence([3, legacy_tag, i]))
            assert not np.array_equal(noise[i], other.standard_normal(6))
    cma_stream = np.random.default_rng(np.random.SeedSequence(3)).standard_normal(6)
    assert not np.array_equal(pair_noise(3, 0, 1, 6)[0], cma_stream)


def test_pinned_streams_keep_their_derivations() -> None:
    """The demo's adapter bytes, bit-exact resumes and GRESO's order rest on these draws."""
    legacy = {
        ("es.minibatch", (4,)): [7, 2, 4],
        ("sft.batches", ()): [7, 1],
        ("data.sft_split", ()): [7, 8],
        ("selection.refill", (4,)): [7, 31, 4],
        ("layerwise.schedule", (2,)): [7, 5, 2],
    }
    for (domain, keys), entropy in legacy.items():
        ours = seeding.seed_sequence(7, domain, *keys).generate_state(4)
        assert np.array_equal(ours, np.random.SeedSequence(entropy).generate_state(4)), domain
    ours = seeding.rng(7, "cma_es.samples").standard_normal(5)
    assert np.array_equal(ours, np.random.default_rng(np.random.SeedSequence(7)).standard_normal(5))


# ----------------------------------------------------------------------------- random rewards


def test_random_reward_draws_at_keys_whatever_the_call_order() -> None:
    from essa.rewards import get_reward

    keys = [(0, 0, g, p, c, 0) for g in range(3) for p in range(10) for c in range(4)]
    n = len(keys)
    texts, answers, prompts = ["x"] * n, [None] * n, [f"q{i}" for i in range(n)]
    whole = get_reward("random", p=0.5).score_with_keys(texts, answers, prompts, keys)
    reward = get_reward("random", p=0.5)
    back = reward.score_with_keys(texts[60:], answers[60:], prompts[60:], keys[60:])
    front = reward.score_with_keys(texts[:60], answers[:60], prompts[:60], keys[:60])
    assert front + back == whole
    assert 0.3 < sum(whole) / n < 0.7  # distinct keys, independent draws


def test_a_negative_reward_seed_is_refused_when_built() -> None:
    from essa.rewards import get_reward

    for name, params in (("random", {}), ("noisy", {"flip_prob": 0.5})):
        with pytest.raises(ValueError, match="seed must be a non-negative integer, got -1"):
            get_reward(name, seed=-1, **params)


def test_noisy_flips_a_group_at_its_key() -> None:
    from essa.rewards import get_reward

    reward = get_reward("noisy", flip_prob=0.5, reward="exact_match")
    # 40 groups of 2 samples; the group key is the item key without its last element
    keys = [(0, 0, 1, p, 0, j) for p in range(40) for j in range(2)]
    prompts = [f"q{p}" for p in range(40) for _ in range(2)]
    scores = reward.score_with_keys(["4"] * 80, ["4"] * 80, prompts, keys)
    assert all(scores[2 * p] == scores[2 * p + 1] for p in range(40))
    assert 10 < scores.count(0.0) / 2 < 30
    # the same groups, reversed and cut in two calls: the same flips
    order = list(reversed(range(80)))
    again = [reward.score_with_keys(["4"], ["4"], [prompts[i]], [keys[i]])[0] for i in order]
    assert again[::-1] == scores


def shard_scores(reward: object, span: range) -> list[list[float | None]]:
    """ESSA's per-candidate scores of population slice ``span`` (as one rank computes them)
    on 3 prompts (training-set indices 5, 1, 8) x 2 samples in generation 3."""
    from essa.es.generation import GENERATION_SITE, draw_keys
    from essa.rewards.fitness import candidate_scores

    prompts, answers, k = ["1+1=", "2+2=", "3+3="], ["2", "4", "6"], 2
    texts = [[f"{c + j}" for _ in prompts for j in range(k)] for c in span]  # (|span|, N*k)
    keys = draw_keys(9, (GENERATION_SITE, 3), [5, 1, 8], span, k)
    scored, _ = candidate_scores(
        reward,  # type: ignore[arg-type]
        texts,
        answers,
        prompts,
        samples_per_prompt=k,
        keys=keys,
    )
    return scored


@pytest.mark.parametrize(
    ("name", "params"), [("random", {"p": 0.5}), ("noisy", {"flip_prob": 0.5})]
)
def test_es_scores_of_a_candidate_are_the_same_in_any_shard(name: str, params: dict) -> None:
    """The whole population scored at once equals two shards scored apart: what one rank
    computes is what two do (the mpiexec test below runs the real thing)."""
    from essa.rewards import get_reward

    reward = get_reward(name, **params)
    whole = shard_scores(reward, range(4))
    assert shard_scores(reward, range(2, 4)) == whole[2:]  # rank 1's shard, scored first
    assert shard_scores(reward, range(0, 2)) == whole[:2]
    assert whole[0] != whole[2] or whole[1] != whole[3]  # candidates draw differently


# -------------------------------------------------------------------- end to end (processes)

NOISY = [
    "reward.name=noisy",
    "reward.params.flip_prob=0.5",
    "reward.params.reward=mpi_helpers:char_variety",
    "generation.samples_per_prompt=2",
    "generation.temperature=1.0",
]
RANDOM = ["reward.name=random", "reward.params.p=0.5"]


@pytest.fixture(scope="module", params=[NOISY, RANDOM], ids=["noisy", "random"])
def reward(request: pytest.FixtureRequest) -> list[str]:
    return request.param


@pytest.fixture(scope="module")
def two_generations(
    reward: list[str], tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A finished one-process 2-generation run: the start the resume test continues from and
    the run the two-rank test must equal (run once per reward; the tests only read it)."""
    run_dir = tmp_path_factory.mktemp("two-generations") / "run"
    train(0, "--run-dir", str(run_dir), sets=small(tiny_model_dir, "run.generations=2", *reward))
    return run_dir


@pytest.mark.slow
def test_resumed_run_draws_what_the_uninterrupted_one_did(
    tiny_model_dir: Path, tmp_path: Path, reward: list[str], two_generations: Path
) -> None:
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train(0, "--run-dir", str(whole), sets=small(tiny_model_dir, "run.generations=3", *reward))
    shutil.copytree(two_generations, resumed)  # resumed in place: a copy leaves the shared one
    train(0, "--resume", str(resumed), sets=["run.generations=3"])
    assert trajectory(resumed) == trajectory(whole)
    assert_same_adapter(resumed, whole)


@pytest.mark.mpi
@needs_mpi
def test_random_rewards_two_ranks_match_one_rank(
    tiny_model_dir: Path, tmp_path: Path, reward: list[str], two_generations: Path
) -> None:
    one, two = two_generations, tmp_path / "two"
    train(2, "--run-dir", str(two), sets=small(tiny_model_dir, "run.generations=2", *reward))
    assert trajectory(two) == trajectory(one)  # fitness, sigma, held-out, ...
    assert_same_adapter(two, one)
