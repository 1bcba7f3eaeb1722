"""Label-free group rewards: TTRL majority vote and EMPO answer frequency (spec §7.1-7.2).

Both are *group rewards*: the completions of one prompt (equal ``prompts`` strings, see
:mod:`essa.rewards.base`) are scored together and must arrive in the same call. The gold
``answers`` are ignored. Answers are extracted as in ``math_accuracy`` and clustered by
math-verify equivalence (:func:`cluster_answers`).

Shared rules:

- a completion with no extractable answer casts no vote, joins no cluster and scores 0.0
  (the policy should not gain from answering nothing);
- a group smaller than ``min_group_size`` (default 2) is not gradable: its items score None.
  With one completion per prompt both rewards are trivially constant, which usually means the
  caller split a group across calls.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from essa.rewards.accuracy import MathVerifier, count_grades
from essa.rewards.base import RewardStats, ScoreFn, group_indices
from essa.rewards.extract import extract_answer

POOLS = ("group", "population")  # whose completions vote (majority_vote's ``pool``)
MIN_GROUP_SIZE = 2  # smaller groups are not gradable (``min_group_size``'s default)


def cluster_answers(
    answers: Sequence[str | None], verifier: MathVerifier, stats: RewardStats | None = None
) -> list[int | None]:
    """Greedy equivalence clustering of extracted answers; cluster ids in order of first
    occurrence, None for a missing answer.

    Each answer joins the first existing cluster whose representative (its first member) it is
    equivalent to, ``verify(representative, answer)`` (gold first, as math-verify is not
    symmetric; equal strings and equal plain numbers are decided without sympy), else opens a
    new cluster. A verification timeout counts as "not equivalent" (and in ``stats.n_timeout``).

    >>> cluster_answers(["1/2", "3", r"\\frac{1}{2}", None, "0.5"], MathVerifier())
    [0, 1, 0, None, 0]
    """
    ids: list[int | None] = []
    representatives: list[str] = []
    known: dict[str, int] = {}  # exact string -> cluster id, skips re-verifying duplicates
    for answer in answers:
        if answer is None:
            ids.append(None)
            continue
        cluster = known.get(answer)
        if cluster is None and representatives:
            grades = verifier.compare(representatives, [answer] * len(representatives))
            if stats is not None:
                count_grades(stats, grades)
            cluster = next((k for k, grade in enumerate(grades) if grade.correct), None)
        if cluster is None:
            cluster = len(representatives)
            representatives.append(answer)
        known[answer] = cluster
        ids.append(cluster)
    return ids


def majority_cluster(ids: Sequence[int | None]) -> int | None:
    """The most common cluster id (None does not vote); ties go to the first occurrence.

    >>> majority_cluster([1, 0, 1, 0, None]), majority_cluster([None]) is None
    (1, True)
    """
    counts = Counter(cluster for cluster in ids if cluster is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(cluster for cluster in ids if cluster is not None and counts[cluster] == best)


def _group_answers(
    completions: list[str], prompts: list[str], use_last_number: bool, min_group_size: int
) -> list[tuple[list[int], list[str | None]]]:
    """(indices, extracted answers) of each group large enough to grade."""
    groups = []
    for group in group_indices(prompts):
        if len(group) >= min_group_size:
            answers = [
                extract_answer(completions[i], use_last_number=use_last_number) for i in group
            ]
            groups.append((group, answers))
    return groups


def _check_group_size(min_group_size: int) -> None:
    if min_group_size < 1:
        raise ValueError(f"min_group_size must be >= 1, got {min_group_size}")


def majority_vote(
    stats: RewardStats,
    *,
    min_group_size: int = MIN_GROUP_SIZE,
    use_last_number: bool = True,
    timeout_seconds: int = 5,
    use_process_pool: bool = False,
    pool: str = "group",
) -> ScoreFn:
    """TTRL majority-vote reward (spec §7.1, arXiv 2504.16084): group reward, no labels.

    In each group, the pseudo-label is the answer cluster with the most members
    (:func:`cluster_answers`; ties go to the cluster seen first), and
    ``R_i = 1[answer_i is in the pseudo-label's cluster]``. A completion without an answer
    scores 0.0; a group where no completion has an answer scores 0.0 throughout; a group
    smaller than ``min_group_size`` scores None. Extraction as in ``math_accuracy``
    (``use_last_number``); ``timeout_seconds``/``use_process_pool`` as in
    :class:`~essa.rewards.accuracy.MathVerifier`.

    ``pool`` says whose completions vote: ``group`` (TTRL: the completions of one prompt in
    the call) or ``population`` (ESSA only: every candidate's completions of the prompt, see
    :mod:`essa.rewards.pool`; the recipe then scores agreement itself, from answer keys, with
    the same ``use_last_number``, and a group of all P candidates' k completions).

    Deviation: TTRL verifies each answer against the voted label string; here membership of
    the label's cluster decides, so a completion's reward never depends on verify's asymmetry.

    >>> from essa.rewards import get_reward
    >>> vote = get_reward("majority_vote")
    >>> vote([r"\\boxed{2}", r"\\boxed{3}", r"\\boxed{2.0}", "none"], [None] * 4, ["q"] * 4)
    [1.0, 0.0, 1.0, 0.0]
    """
    _check_group_size(min_group_size)
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {', '.join(POOLS)}, got {pool!r}")
    verifier = MathVerifier(timeout_seconds=timeout_seconds, use_process_pool=use_process_pool)

    def score(
        completions: list[str], answers: list[str | None], prompts: list[str]
    ) -> list[float | None]:
        scores: list[float | None] = [None] * len(completions)
        for group, extracted in _group_answers(
            completions, prompts, use_last_number, min_group_size
        ):
            ids = cluster_answers(extracted, verifier, stats)
            label = majority_cluster(ids)
            for i, cluster in zip(group, ids, strict=True):
                scores[i] = float(label is not None and cluster == label)
        return scores

    return score


def semantic_entropy(ids: Sequence[int | None]) -> float:
    """``H = -sum_c p(c) log p(c)`` with ``p(c) = |c| / G`` over the G items of a group, each
    missing answer counted as its own singleton cluster (as in EMPO's code).

    >>> round(semantic_entropy([0, 0, 1, None]), 6) == round(-(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)), 6)
    True
    """
    size = len(ids)
    sizes = list(Counter(cluster for cluster in ids if cluster is not None).values())
    sizes += [1] * sum(cluster is None for cluster in ids)
    return -math.fsum((n / size) * math.log(n / size) for n in sizes)


def answer_frequency(
    stats: RewardStats,
    *,
    min_group_size: int = MIN_GROUP_SIZE,
    use_entropy_filter: bool = False,
    use_last_number: bool = True,
    timeout_seconds: int = 5,
    use_process_pool: bool = False,
) -> ScoreFn:
    """EMPO semantic-cluster frequency (spec §7.2, arXiv 2504.05812): group reward, no labels.

    ``R_i = p(c(o_i)) = |c(o_i)| / G``: the share of the G completions of the group that fall
    in the completion's own answer cluster (:func:`cluster_answers`). A completion without an
    answer scores 0.0 (and still counts in G). With ``use_entropy_filter`` (EMPO's TRL code),
    a group whose semantic entropy (:func:`semantic_entropy`) reaches ``log G`` (every answer
    distinct) scores 0.0 throughout. Group-normalising this reward minimises semantic entropy.
    A group smaller than ``min_group_size`` scores None.

    >>> from essa.rewards import get_reward
    >>> freq = get_reward("answer_frequency")
    >>> freq([r"\\boxed{2}", r"\\boxed{3}", r"\\boxed{2.0}", "none"], [None] * 4, ["q"] * 4)
    [0.5, 0.25, 0.5, 0.0]
    """
    _check_group_size(min_group_size)
    verifier = MathVerifier(timeout_seconds=timeout_seconds, use_process_pool=use_process_pool)

    def score(
        completions: list[str], answers: list[str | None], prompts: list[str]
    ) -> list[float | None]:
        scores: list[float | None] = [None] * len(completions)
        for group, extracted in _group_answers(
            completions, prompts, use_last_number, min_group_size
        ):
            ids = cluster_answers(extracted, verifier, stats)
            size = len(group)
            counts = Counter(cluster for cluster in ids if cluster is not None)
            # Tolerance: H equals log G exactly only up to rounding.
            filtered = use_entropy_filter and semantic_entropy(ids) >= math.log(size) - 1e-12
            for i, cluster in zip(group, ids, strict=True):
                scores[i] = 0.0 if filtered or cluster is None else counts[cluster] / size
        return scores

    return score
