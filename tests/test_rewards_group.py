"""Group rewards, log-probability rewards, the RPR pattern reward and the noise wrapper:
exact values from the formulas of rewards-and-eval.md §7-8."""

from __future__ import annotations

import math

import pytest

from essa.rewards import (
    LogprobReward,
    LogprobScorer,
    MathVerifier,
    MissingInputError,
    Reward,
    cluster_answers,
    combine,
    get_reward,
    group_indices,
    known_rewards,
    majority_cluster,
    noisy,
    reward_spec,
)
from essa.rewards.label_free import semantic_entropy
from essa.rewards.pattern import RPR_PHRASES, ngram_repetition_ratio, reasoning_pattern_score


def test_registry_marks_group_and_logprob_rewards() -> None:
    assert {
        "majority_vote",
        "answer_frequency",
        "self_confidence",
        "reference_logprob",
        "reasoning_pattern",
        "noisy",
        "reward_model",
        "gym_score",
    } <= set(known_rewards())
    assert reward_spec("majority_vote").is_group and reward_spec("answer_frequency").is_group
    assert reward_spec("noisy").is_group
    assert not reward_spec("math_accuracy").is_group
    assert reward_spec("self_confidence").needs == "completion_logprobs"
    assert reward_spec("reference_logprob").needs == "reference_logprobs"
    assert reward_spec("format").needs is None
    assert get_reward("majority_vote").is_group
    assert not get_reward("exact_match").is_group
    assert get_reward("self_confidence").needs == frozenset({"completion_logprobs"})
    assert get_reward("exact_match").needs == frozenset()
    with pytest.raises(ValueError, match="known rewards: .*majority_vote"):
        reward_spec("majority")


def test_required_parameters_are_named() -> None:
    with pytest.raises(ValueError, match="'noisy' needs parameter.*flip_prob"):
        get_reward("noisy")
    with pytest.raises(ValueError, match="'reward_model' needs parameter.*model"):
        get_reward("reward_model")
    with pytest.raises(ValueError, match="unknown parameter.*bogus.*accepted: .*batch_size"):
        get_reward("reward_model", model="x", bogus=1)


def test_custom_group_reward(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_group_rewards.py").write_text(
        "def group_size(completions, answers, prompts):\n"
        "    return [float(prompts.count(p)) for p in prompts]\n"
        "group_size.is_group = True\n"
        "def plain(completions, answers, prompts):\n"
        "    return [1.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = get_reward("my_group_rewards:group_size")
    assert reward.is_group
    assert reward(["a", "b", "c"], [None] * 3, ["p", "q", "p"]) == [2.0, 1.0, 2.0]
    assert not get_reward("my_group_rewards:plain").is_group


def test_group_indices() -> None:
    assert group_indices(["a", "b", "a", "c", "b"]) == [[0, 2], [1, 4], [3]]
    assert group_indices([]) == []


# ---------------------------------------------------------------------------------------------
# Clustering, majority vote (TTRL), answer frequency (EMPO)


def test_cluster_answers_by_equivalence() -> None:
    verifier = MathVerifier()
    answers = [r"\frac{1}{2}", "3", "0.5", None, "1/2", r"\{1,2\}", r"\{2,1\}", "3.0"]
    assert cluster_answers(answers, verifier) == [0, 1, 0, None, 0, 2, 2, 1]
    assert cluster_answers([None, None], verifier) == [None, None]
    assert majority_cluster([1, 0, 0, 1]) == 1  # tie: first occurrence
    assert majority_cluster([None, 2, 0, 0]) == 0
    assert majority_cluster([None]) is None


def test_majority_vote_exact_values() -> None:
    vote = get_reward("majority_vote")
    completions = [
        r"\boxed{\frac{1}{2}}",  # q1: cluster 1/2 has 3 of 5 votes
        r"\boxed{3}",
        "The answer is 0.5.",
        "I give up.",  # no answer: no vote, 0
        r"\boxed{1/2}",
        r"\boxed{7}",  # q2: tie 7 vs 8 -> 7 (first occurrence)
        r"\boxed{8}",
        "#### 7.0",
        r"\boxed{8}",
        "nothing",  # q3: nobody answers -> all 0
        "nothing either",
        r"\boxed{5}",  # q4: group of one -> None (min_group_size 2)
    ]
    prompts = ["q1", "q1", "q1", "q1", "q1", "q2", "q2", "q2", "q2", "q3", "q3", "q4"]
    scores = vote(completions, [None] * 12, prompts)
    assert scores == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, None]
    assert vote.stats.as_dict() == {"n_items": 12, "n_none": 1, "n_error": 0, "n_timeout": 0}
    # Group members need not be adjacent, and the gold answers are ignored.
    shuffled = [completions[i] for i in (5, 0, 6, 1, 7, 2, 8, 3, 4)]
    shuffled_prompts = [prompts[i] for i in (5, 0, 6, 1, 7, 2, 8, 3, 4)]
    assert vote(shuffled, ["99"] * 9, shuffled_prompts) == [
        1.0,
        1.0,
        0.0,
        0.0,
        1.0,
        1.0,
        0.0,
        0.0,
        1.0,
    ]
    single = get_reward("majority_vote", min_group_size=1)
    assert single([r"\boxed{5}"], [None], ["q"]) == [1.0]
    with pytest.raises(ValueError, match="min_group_size"):
        get_reward("majority_vote", min_group_size=0)


def test_answer_frequency_exact_values() -> None:
    freq = get_reward("answer_frequency")
    completions = [r"\boxed{2}", r"\boxed{3}", r"\boxed{2.0}", "none", r"\boxed{\frac{4}{2}}"]
    # G = 5: cluster {2} has 3 members -> 3/5, {3} -> 1/5, no answer -> 0.
    assert freq(completions, [None] * 5, ["q"] * 5) == pytest.approx([0.6, 0.2, 0.6, 0.0, 0.6])
    distinct = [r"\boxed{1}", r"\boxed{2}", r"\boxed{3}"]
    assert freq(distinct, [None] * 3, ["q"] * 3) == pytest.approx([1 / 3] * 3)
    filtered = get_reward("answer_frequency", use_entropy_filter=True)
    assert filtered(distinct, [None] * 3, ["q"] * 3) == [0.0, 0.0, 0.0]
    # H of {2,2,3} = -(2/3 ln 2/3 + 1/3 ln 1/3) < ln 3: kept.
    kept = [r"\boxed{2}", r"\boxed{2}", r"\boxed{3}"]
    assert filtered(kept, [None] * 3, ["q"] * 3) == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    # A missing answer counts as a singleton cluster in H: {1, 2, none} is all distinct.
    assert filtered([r"\boxed{1}", r"\boxed{2}", "none"], [None] * 3, ["q"] * 3) == [0.0] * 3
    assert semantic_entropy([0, 0, 1]) == pytest.approx(
        -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    )
    assert semantic_entropy([0, None, 1]) == pytest.approx(math.log(3))


def test_group_reward_error_isolation_is_per_group() -> None:
    def fragile(completions, answers, prompts):
        if "boom" in completions:
            raise RuntimeError("bad group")
        return [float(len(completions))] * len(completions)

    reward = Reward("fragile", fragile, is_group=True)
    # The batch fails, then each group is re-scored whole: q2's group fails, q1's keeps size 2.
    assert reward(["a", "boom", "b", "c"], [None] * 4, ["q1", "q2", "q1", "q2"]) == [
        2.0,
        None,
        2.0,
        None,
    ]
    assert reward.stats.n_error == 2


# ---------------------------------------------------------------------------------------------
# Log-probability rewards with a fake scorer (the real LogprobScorer is a backend's
# token_logprobs method; this fake returns log(0.5) per character of the continuation).


class FakeScorer:
    """Fake backend hook: every character is one token with probability 1/2."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], list[str]]] = []

    def token_logprobs(self, prompts: list[str], continuations: list[str]) -> list[list[float]]:
        self.calls.append((list(prompts), list(continuations)))
        return [[math.log(0.5)] * len(text) for text in continuations]


def test_fake_scorer_satisfies_protocol() -> None:
    assert isinstance(FakeScorer(), LogprobScorer)


def test_self_confidence_exact_values() -> None:
    scorer = FakeScorer()
    raw = get_reward("self_confidence", scorer=scorer, use_length_norm=False)
    assert isinstance(raw, LogprobReward)
    # pi(y|x) = 0.5 ** len(y); empty completion -> None
    assert raw(["ab", "abc", ""], [None] * 3, ["q", "q", "q"]) == pytest.approx([0.25, 0.125, None])
    assert scorer.calls[0] == (["q", "q", "q"], ["ab", "abc", ""])
    normed = get_reward("self_confidence", scorer=FakeScorer(), alpha=0.1)
    # exp(mean log p) = 0.5 for any length; + alpha
    assert normed(["ab", "abcd"], [None] * 2, ["q"] * 2) == pytest.approx([0.6, 0.6])
    # Precomputed log-probs (e.g. from vLLM generation) take the same formula.
    plain = get_reward("self_confidence")
    lp = [[math.log(0.9), math.log(0.4)], [0.0]]
    assert plain.score_with_logprobs(["x", "y"], [None] * 2, ["q", "q"], lp) == pytest.approx(
        [math.sqrt(0.36), 1.0]
    )
    # A bad log-prob is a bad item: None, counted.
    assert plain.score_with_logprobs(["x"], [None], ["q"], [[0.5]]) == [None]
    assert plain.stats.n_error == 1
    with pytest.raises(ValueError, match="differ in length"):
        plain.score_with_logprobs(["x"], [None], ["q"], [])


def test_logprob_reward_without_scorer_is_a_clear_error() -> None:
    plain = get_reward("self_confidence")
    with pytest.raises(MissingInputError, match="needs token log-probs.*scorer"):
        plain(["x"], [None], ["q"])
    with pytest.raises(MissingInputError):
        combine([(plain, 1.0)])
    with pytest.raises(MissingInputError):
        noisy(plain, 0.5)
    plain.scorer = FakeScorer()
    assert plain(["ab"], [None], ["q"]) == pytest.approx([0.5])


def test_reference_logprob_exact_values() -> None:
    scorer = FakeScorer()
    reward = get_reward("reference_logprob", scorer=scorer)
    completions = ["ignored", "also ignored", "x", "y"]
    references = ["abc", "abc", None, "abcd"]
    prompts = ["q1", "q1", "q2", "q2"]
    # Mean token log-prob of the reference: log(0.5) whatever its length; None without one.
    assert reward(completions, references, prompts) == pytest.approx(
        [math.log(0.5), math.log(0.5), None, math.log(0.5)]
    )
    # Each distinct (prompt, reference) pair is scored once.
    assert sorted(zip(*scorer.calls[0], strict=True)) == [("q1", "abc"), ("q2", "abcd")]
    plain = get_reward("reference_logprob")
    lp = [[-1.0, -2.0, -3.0], [], None]
    assert plain.score_with_logprobs(["", "", ""], ["abc", "x", None], ["q"] * 3, lp) == [
        -2.0,
        None,
        None,
    ]


def test_logprob_reward_inside_combine() -> None:
    conf = get_reward("self_confidence", scorer=FakeScorer(), use_length_norm=False)
    both = combine([(conf, 1.0), (get_reward("exact_match"), 2.0)])
    assert both(["ab", "4"], ["4", "4"], ["q", "q"]) == pytest.approx([0.25, 2.5])


# ---------------------------------------------------------------------------------------------
# Reasoning-pattern reward (RPR) and the noise wrapper


def test_ngram_repetition_ratio() -> None:
    assert ngram_repetition_ratio("a b a b a", 2) == 0.5  # (a b), (b a) repeat; 4 bigrams
    assert ngram_repetition_ratio("a b c", 2) == 0.0
    assert ngram_repetition_ratio("a b", 3) == 0.0  # no trigram at all
    # As in the source: *distinct* repeated n-grams over all n-grams, so one 20-gram repeated
    # many times counts once ("x" * 21: 1 of 2; "x" * 119: 1 of 100).
    assert ngram_repetition_ratio("x " * 21, 20) == 0.5
    assert ngram_repetition_ratio("x " * 119, 20) == 0.01


def test_reasoning_pattern_score_exact_values() -> None:
    assert len(RPR_PHRASES) == 40
    assert reasoning_pattern_score("Wait, we need to add. Thus 4; therefore 4.") == pytest.approx(
        4 / 20
    )
    # Text before the first <think> is ignored; each phrase counts once; case-insensitive.
    text = "Thus, hence <think>THUS thus. Hence. Alternatively, let me check."
    assert reasoning_pattern_score(text) == pytest.approx(4 / 20)
    # Capped at 1 with all phrases, then minus the repetition ratio of word 20-grams.
    everything = " . ".join(RPR_PHRASES)
    assert reasoning_pattern_score(everything) == pytest.approx(1.0)
    repeated = everything + " " + " ".join(["same"] * 21)
    words = repeated.lower().split()
    n_grams = len(words) - 19
    assert reasoning_pattern_score(repeated) == pytest.approx(1.0 - 1 / n_grams)
    # An invented user turn costs 1 per occurrence; the score is floored at 0.
    assert reasoning_pattern_score("wait thus hence User: hi") == 0.0
    assert reasoning_pattern_score("no phrases") == 0.0


def test_reasoning_pattern_reward_requires_an_answer() -> None:
    rpr = get_reward("reasoning_pattern")
    texts = [r"Wait, thus \boxed{4}", "Wait, thus 4", "wait thus. The answer is 4."]
    assert rpr(texts, [None] * 3, [""] * 3) == pytest.approx([0.1, 0.0, 0.1])
    loose = get_reward("reasoning_pattern", require_answer=False)
    assert loose(texts[1:2], [None], [""]) == pytest.approx([0.1])


def test_noisy_flips_whole_groups() -> None:
    base = get_reward("exact_match")
    completions = ["4", "5", "4", "4", "x"]
    answers = ["4", "4", "4", "4", None]
    prompts = ["a", "a", "b", "c", "c"]
    assert noisy(base, 1.0)(completions, answers, prompts) == [0.0, 1.0, 0.0, 0.0, None]
    assert noisy(base, 0.0)(completions, answers, prompts) == [1.0, 0.0, 1.0, 1.0, None]
    # One decision per group: members of a group are flipped together.
    many = noisy(base, 0.5, seed=3)
    prompts = [f"p{i // 4}" for i in range(400)]
    scores = many(["4"] * 400, ["4"] * 400, prompts)
    groups = [scores[i : i + 4] for i in range(0, 400, 4)]
    assert all(len(set(group)) == 1 for group in groups)
    flipped = sum(group[0] == 0.0 for group in groups)
    assert 30 < flipped < 70
    # Seeded: the same seed and calls give the same flips.
    assert noisy(base, 0.5, seed=3)(["4"] * 400, ["4"] * 400, prompts) == scores
    registered = get_reward("noisy", flip_prob=1.0, reward="exact_match")
    assert registered.is_group
    assert registered(["4", "5"], ["4", "4"], ["a", "b"]) == [0.0, 1.0]
    with pytest.raises(ValueError, match="flip_prob"):
        noisy(base, 1.5)
