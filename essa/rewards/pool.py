"""The population as the vote pool: TTRL-style majority vote over all candidates' answers.

TTRL (arXiv 2504.16084, spec rewards-and-eval.md §7.1) votes among the completions that one
policy samples for a prompt. An ES population offers a second pool at no extra generation cost:
the P candidates of a generation all answer the same prompts, so the majority answer of prompt
i over *every candidate's* completions is a pseudo-label, and each candidate is rewarded for
agreeing with it (``reward.params.pool: population``; one greedy completion per candidate and
prompt suffices). No published ES system does this; it is our extension.

Under MPI each rank holds only its own candidates' texts. Only an 8-byte key per extracted
answer crosses ranks (:func:`answer_key`), never text, and the vote is a pure function of the
gathered (P, N) key matrix in candidate order, so every rank, and every rank count, computes
the same labels and rewards.

Deviation from TTRL: answers are grouped by a canonical string (exact rationals for plain
numbers, fractions and decimals; whitespace-free text otherwise) rather than by math-verify
equivalence, because equivalence cannot be decided on hashes. For the numeric answers of
math reasoning tasks the two agree; symbolic answers that are equal but written differently
(``\\sqrt{4}`` and ``2``) vote separately.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from essa.rewards.extract import extract_answer

NO_ANSWER = 0  # the key of a completion without an extractable answer: it casts no vote

_FRAC = re.compile(r"^\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")


def canonical_answer(answer: str) -> str:
    r"""The string two equal answers share: a reduced fraction for numbers, else the text.

    >>> [canonical_answer(a) for a in ["2", "2.0", "-0.50", "1/2", r"\frac{2}{4}", "x + 1"]]
    ['2', '2', '-1/2', '1/2', '1/2', 'x+1']
    """
    text = "".join(answer.split())
    match = _FRAC.match(text)
    if match:
        text = f"{match.group(1)}/{match.group(2)}"
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        return text
    return str(value)


def answer_key(completion: str, *, use_last_number: bool = True) -> int:
    """A signed 64-bit key of the completion's extracted answer; ``NO_ANSWER`` (0) if none.

    Equal canonical answers give equal keys on every machine (BLAKE2b, not Python's salted
    ``hash``); a collision of two different answers has probability about 2^-64.
    """
    answer = extract_answer(completion, use_last_number=use_last_number)
    if answer is None:
        return NO_ANSWER
    digest = hashlib.blake2b(canonical_answer(answer).encode(), digest_size=8).digest()
    key = int.from_bytes(digest, "little", signed=True)
    return key if key != NO_ANSWER else 1  # keep 0 for "no answer"


def answer_keys(
    completions: Sequence[Sequence[str]], *, use_last_number: bool = True
) -> np.ndarray:
    """Keys of completions[candidate][item]: (p, M) int64 for this rank's p candidates.

    A rank with no candidates (more ranks than candidates) has p = 0 and, with no row to read
    M from, M = 0: ``(0, 0)`` reshapes to any ``(0, M)``.

    >>> answer_keys([]).shape, answer_keys([["7"], ["x"]]).shape
    ((0, 0), (2, 1))
    """
    items = len(completions[0]) if len(completions) else 0
    return np.array(
        [[answer_key(t, use_last_number=use_last_number) for t in row] for row in completions],
        dtype=np.int64,
    ).reshape(len(completions), items)


def population_majority(keys: np.ndarray, groups: Sequence[Sequence[int]]) -> np.ndarray:
    """The majority key of each group of columns over all candidates: (len(groups),) int64.

    ``keys`` is the gathered (P, M) matrix in candidate order; ``groups[g]`` lists the columns
    (items) that belong to prompt g (one column per prompt with one sample per prompt, k columns
    with k samples). Missing answers do not vote; a group with no answer gets ``NO_ANSWER``.
    A tie goes to the smallest key: a pseudo-random but fixed choice that depends neither on
    the candidates' order in the population nor on the rank count (the first-seen rule of
    TTRL's code would make a candidate's fitness depend on its position).

    >>> keys = np.array([[5, 7], [5, 0], [9, 0]])
    >>> population_majority(keys, [[0], [1]]).tolist()
    [5, 7]
    >>> population_majority(np.array([[4], [3]]), [[0]]).tolist()  # a tie: the smaller key
    [3]
    """
    out = np.full(len(groups), NO_ANSWER, dtype=np.int64)
    for g, columns in enumerate(groups):
        votes = keys[:, list(columns)].ravel()  # candidate-major
        votes = votes[votes != NO_ANSWER]
        if votes.size == 0:
            continue
        values, counts = np.unique(votes, return_counts=True)  # values sorted ascending
        out[g] = values[np.argmax(counts)]  # argmax takes the first, i.e. smallest, of a tie
    return out


def agreement_rewards(
    keys: np.ndarray, majority: np.ndarray, groups: Sequence[Sequence[int]]
) -> np.ndarray:
    """1.0 where a candidate's answer equals its prompt's majority answer, else 0.0: (p, M).

    ``keys`` may be any subset of the population's rows (a rank's own shard). A completion
    without an answer scores 0.0, as in :func:`essa.rewards.label_free.majority_vote`.
    """
    label = np.full(keys.shape[1], NO_ANSWER, dtype=np.int64)
    for g, columns in enumerate(groups):
        label[list(columns)] = majority[g]
    return ((keys == label[None, :]) & (keys != NO_ANSWER)).astype(np.float64)


def majority_share(
    keys: np.ndarray, majority: np.ndarray, groups: Sequence[Sequence[int]]
) -> float:
    """TTRL's ``majority_ratio`` over the population: the share of votes the labels won."""
    agree = agreement_rewards(keys, majority, groups)
    return float(agree.mean()) if agree.size else float("nan")
