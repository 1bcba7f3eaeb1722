"""The reward contract: a batch callable, its error accounting, weighted sums and fitness.

A reward is called as ``reward(completions, answers, prompts) -> list[float | None]`` with three
equal-length lists; ``None`` means "cannot be graded" and is skipped by
:func:`fitness_from_rewards` (spec rewards-and-eval.md §1).

**Grouping contract.** Items whose ``prompts`` entries are *equal strings* form one group: the
completions sampled for the same prompt. A *group reward* (``reward.is_group``; majority vote,
answer frequency, the ``noisy`` wrapper) scores each completion relative to the other members of
its group *in the same call*, so the caller must pass every completion of a prompt in one call
(members need not be adjacent; order within a group matters only for tie-breaking, which goes to
the first occurrence). A group split across calls is scored as separate, smaller groups. Plain
rewards score each item on its own and do not care how a batch is cut. For ES fitness this means:
pool the completions of all candidates for the shared prompt batch into one call, then split the
scores back per candidate (:func:`group_indices` gives the groups).

**Side inputs.** ``reward.needs`` names inputs a reward needs beyond the three lists (empty for
text rewards; ``{"completion_logprobs"}`` or ``{"reference_logprobs"}`` for the log-probability
rewards of :mod:`essa.rewards.logprob`, which say how a backend supplies them;
``{"draw_keys"}`` for the random rewards, :class:`KeyedReward`).

**Draw keys.** A random reward (``random``, ``noisy``) draws from where each item sits in the
run, never from how many draws came before: the recipe gives item i its key ``keys[i]``, a tuple
of non-negative ints ``(run seed, *where, sample)`` whose last element is the item's sample
index in its group, so that the group's key is the rest. ESSA keys an item by (generation,
prompt, candidate, sample), GRPO by (step, round, prompt, sample). A candidate then scores the
same on one rank or N, wherever it sits in its rank's shard, and after a resume.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real
from types import MappingProxyType

from essa import seeding

logger = logging.getLogger(__name__)

# The plain batch function a Reward wraps: (completions, answers, prompts) -> scores.
ScoreFn = Callable[[list[str], list[str | None], list[str]], list[float | None]]
DRAW_KEYS = "draw_keys"
DrawKey = tuple[int, ...]  # (run seed, *where in the run, sample): see the module docstring
# A KeyedReward's function: (completions, answers, prompts, keys) -> scores.
KeyedScoreFn = Callable[[list[str], list[str | None], list[str], list[DrawKey]], list[float | None]]


@dataclass
class RewardStats:
    """Running counters of one reward since construction (or the last :meth:`reset`).

    - ``n_items``: items scored.
    - ``n_none``: items whose score is None (not gradable), errors included.
    - ``n_error``: items whose reward function raised or returned something unusable
      (their score is None).
    - ``n_timeout``: items whose verification timed out; they score 0.0, not None, so that a
      policy cannot gain from slow-to-verify output (spec §3.4).

    Thread-safe; read a consistent snapshot with :meth:`as_dict`.
    """

    n_items: int = 0
    n_none: int = 0
    n_error: int = 0
    n_timeout: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(
        self, *, n_items: int = 0, n_none: int = 0, n_error: int = 0, n_timeout: int = 0
    ) -> None:
        with self._lock:
            self.n_items += n_items
            self.n_none += n_none
            self.n_error += n_error
            self.n_timeout += n_timeout

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {
                "n_items": self.n_items,
                "n_none": self.n_none,
                "n_error": self.n_error,
                "n_timeout": self.n_timeout,
            }

    def reset(self) -> None:
        with self._lock:
            self.n_items = self.n_none = self.n_error = self.n_timeout = 0


def _as_score(value: object) -> float | None:
    """float for a finite real (bools included), None for None/NaN; ValueError otherwise."""
    if value is None:
        return None
    if not isinstance(value, Real):
        raise ValueError(f"reward value {value!r} is not a real number or None")
    score = float(value)
    if math.isnan(score):
        return None
    if math.isinf(score):
        raise ValueError(f"reward value {score} is not finite")
    return score


def group_indices(prompts: Sequence[str]) -> list[list[int]]:
    """Item indices grouped by equal prompt string, groups in order of first occurrence.

    >>> group_indices(["a", "b", "a", "c", "b"])
    [[0, 2], [1, 4], [3]]
    """
    groups: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt, []).append(i)
    return list(groups.values())


class Reward:
    """A named batch reward with error isolation and counters.

    Calling it scores each item. If the wrapped function raises, or returns a list of the wrong
    length or with a value that is not a real number or None, the batch is re-scored one item
    at a time (one *group* at a time for a group reward, see the module docstring); an item
    that still fails scores None and is counted in ``stats.n_error`` (logged once per call).
    A reward never raises for bad items; it raises ValueError only when the input lists differ
    in length.

    Attributes:
        is_group: scores depend on the other completions of the same prompt in the call.
        needs: side inputs beyond (completions, answers, prompts); empty for text rewards.
    """

    needs: frozenset[str] = frozenset()
    pool: str = "group"  # "population": ESSA votes over all candidates (essa.rewards.pool)
    # The parameters a registered reward was built with; the population vote, scored outside
    # the reward, reads its extraction and group-size parameters here.
    params: Mapping[str, object] = MappingProxyType({})

    def __init__(
        self, name: str, fn: ScoreFn, stats: RewardStats | None = None, *, is_group: bool = False
    ) -> None:
        self.name = name
        self.fn: Callable[..., object] = fn
        self.stats = stats if stats is not None else RewardStats()
        self.is_group = is_group

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def __call__(
        self, completions: list[str], answers: list[str | None], prompts: list[str]
    ) -> list[float | None]:
        return self._score_columns(
            ("completions", "answers", "prompts"), (completions, answers, prompts)
        )

    def _score_columns(
        self, names: tuple[str, ...], columns: tuple[Sequence[object], ...]
    ) -> list[float | None]:
        """Score ``self.fn(*columns)``; ``columns[2]`` are the prompts (they define groups)."""
        lengths = [len(column) for column in columns]
        if len(set(lengths)) > 1:
            raise ValueError(
                f"reward {self.name!r}: {', '.join(names[:-1])} and {names[-1]} differ in length "
                f"({', '.join(map(str, lengths))})"
            )
        lists = tuple(list(column) for column in columns)
        try:
            scores = self._checked(self.fn(*lists), lengths[0])
        except Exception:
            scores = self._score_pieces(lists)
        n_none = sum(score is None for score in scores)
        self.stats.add(n_items=len(scores), n_none=n_none)
        return scores

    @staticmethod
    def _checked(raw: object, n: int) -> list[float | None]:
        if not isinstance(raw, (list, tuple)) or len(raw) != n:
            raise ValueError(f"expected a list of {n} scores, got {type(raw).__name__}")
        return [_as_score(value) for value in raw]

    def _score_pieces(self, columns: tuple[list[object], ...]) -> list[float | None]:
        """Re-score item by item (group by group for a group reward); failures score None."""
        n = len(columns[0])
        prompts = columns[2]
        pieces = group_indices(prompts) if self.is_group else [[i] for i in range(n)]  # type: ignore[arg-type]
        scores: list[float | None] = [None] * n
        first_error: Exception | None = None
        n_failed = 0
        for piece in pieces:
            try:
                part = self._checked(
                    self.fn(*([column[i] for i in piece] for column in columns)), len(piece)
                )
            except Exception as error:
                n_failed += len(piece)
                self.stats.add(n_error=len(piece))
                first_error = first_error or error
                continue
            for i, score in zip(piece, part, strict=True):
                scores[i] = score
        if first_error is not None:
            logger.warning(
                "reward %r failed on %d of %d items (scored None); first error: %r",
                self.name,
                n_failed,
                n,
                first_error,
            )
        return scores

    def check_callable(self) -> None:
        """Raise ValueError if the plain 3-list call cannot work (a side input is not bound)."""


class KeyedReward(Reward):
    """A reward with random draws, taken at each item's draw key (see the module docstring).

    Recipes call :meth:`score_with_keys`. Called with the three lists alone (library use),
    item j of group g in the n-th such call gets the key ``(n, g, j)``, so the draws follow the
    call order, as with one seeded generator.
    """

    needs = frozenset({DRAW_KEYS})

    def __init__(
        self,
        name: str,
        fn: KeyedScoreFn,
        stats: RewardStats | None = None,
        *,
        is_group: bool = False,
    ) -> None:
        super().__init__(name, fn, stats, is_group=is_group)  # type: ignore[arg-type]
        self._plain_calls = 0

    def __call__(
        self, completions: list[str], answers: list[str | None], prompts: list[str]
    ) -> list[float | None]:
        keys: list[DrawKey] = [()] * len(prompts)
        for g, group in enumerate(group_indices(prompts)):
            for j, i in enumerate(group):
                keys[i] = (self._plain_calls, g, j)
        self._plain_calls += 1
        return self.score_with_keys(completions, answers, prompts, keys)

    def score_with_keys(
        self,
        completions: list[str],
        answers: list[str | None],
        prompts: list[str],
        keys: Sequence[DrawKey],
    ) -> list[float | None]:
        """Score, item i drawing at ``keys[i]``."""
        return self._score_columns(
            ("completions", "answers", "prompts", "keys"),
            (completions, answers, prompts, list(keys)),
        )


def check_seed(seed: object) -> None:
    """A random reward's ``seed`` parameter: a non-negative integer (ValueError otherwise)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")


def score(
    reward: Reward,
    completions: list[str],
    answers: list[str | None],
    prompts: list[str],
    keys: Sequence[DrawKey],
) -> list[float | None]:
    """``reward``'s scores: a :class:`KeyedReward` draws at ``keys``, any other ignores them."""
    if isinstance(reward, KeyedReward):
        return reward.score_with_keys(completions, answers, prompts, keys)
    return reward(completions, answers, prompts)


def fitness_from_rewards(scores: Sequence[float | None]) -> float:
    """ESSA fitness of one candidate: mean of the non-None rewards, NaN if all are None.

    >>> fitness_from_rewards([1.0, None, 0.0])
    0.5
    >>> import math; math.isnan(fitness_from_rewards([None, None]))
    True
    """
    graded = [score for score in scores if score is not None]
    return math.fsum(graded) / len(graded) if graded else math.nan


def combine(parts: Sequence[tuple[Reward, float]], name: str | None = None) -> Reward:
    """Weighted sum ``R = sum_k w_k * R_k`` of rewards, e.g. ``0.9 * acc + 0.1 * format``.

    None handling: a part that scores None for an item contributes nothing to that item (the
    weights are *not* renormalised); the combined score is None only when every part is None.
    Each part keeps its own ``stats``; the combination has its own as well. The combination is
    a group reward if any part is, and draws at the items' keys (a :class:`KeyedReward`) if any
    part does. Parts are called with the three lists, so a log-probability reward must have its
    scorer bound (see :mod:`essa.rewards.logprob`).

    >>> from essa.rewards import get_reward
    >>> both = combine([(get_reward("exact_match"), 0.9), (get_reward("format"), 0.1)])
    >>> both([r"\\boxed{4}", "4"], ["4", "4"], ["", ""])
    [0.1, 0.9]
    """
    if not parts:
        raise ValueError("combine needs at least one (reward, weight) pair")
    for reward, weight in parts:
        if not isinstance(reward, Reward):
            raise TypeError(f"combine expects Reward objects, got {type(reward).__name__}")
        if not math.isfinite(weight):
            raise ValueError(f"weight of {reward.name!r} is not finite: {weight}")
        reward.check_callable()

    def weighted_sum(
        completions: list[str],
        answers: list[str | None],
        prompts: list[str],
        keys: list[DrawKey],
    ) -> list[float | None]:
        columns = [
            (score(reward, completions, answers, prompts, keys), weight) for reward, weight in parts
        ]
        totals: list[float | None] = []
        for i in range(len(completions)):
            terms = [(scores[i], weight) for scores, weight in columns]
            graded = [weight * value for value, weight in terms if value is not None]
            totals.append(math.fsum(graded) if graded else None)
        return totals

    label = name or " + ".join(f"{weight:g}*{reward.name}" for reward, weight in parts)
    is_group = any(reward.is_group for reward, _ in parts)
    if any(isinstance(reward, KeyedReward) for reward, _ in parts):
        return KeyedReward(label, weighted_sum, is_group=is_group)
    plain = functools.partial(weighted_sum, keys=[])  # no part reads the keys
    return Reward(label, plain, is_group=is_group)


def noisy(reward: Reward, flip_prob: float, seed: int = 0, name: str | None = None) -> KeyedReward:
    """Reward-noise wrapper (spec §8, "The Climb Carves Wisdom Deeper Than the Summit").

    For each group of completions of the same prompt (see the module docstring), with
    probability ``flip_prob`` the whole group's rewards are flipped, ``r -> 1 - r``; otherwise
    they are kept. None stays None. The decision is drawn once per group, at the group's draw
    key (its first item's key without the sample index) in the ``reward.noisy`` stream of
    ``seed`` (:mod:`essa.seeding`). Meant for rewards in [0, 1] (binary correctness). Always a
    group reward; with one completion per prompt every item is its own group.

    >>> from essa.rewards import get_reward
    >>> noisy(get_reward("exact_match"), flip_prob=1.0)(["4", "5", "4"], ["4", "4", "4"], ["a", "a", "b"])
    [0.0, 1.0, 0.0]
    """
    if not 0.0 <= flip_prob <= 1.0:
        raise ValueError(f"flip_prob must be in [0, 1], got {flip_prob}")
    if not isinstance(reward, Reward):
        raise TypeError(f"noisy expects a Reward, got {type(reward).__name__}")
    check_seed(seed)
    reward.check_callable()

    def flipped(
        completions: list[str],
        answers: list[str | None],
        prompts: list[str],
        keys: list[DrawKey],
    ) -> list[float | None]:
        scores = score(reward, completions, answers, prompts, keys)
        for group in group_indices(prompts):
            where = keys[group[0]][:-1]  # the group's key: its items' without the sample
            if seeding.rng(seed, "reward.noisy", *where).random() < flip_prob:
                for i in group:
                    value = scores[i]
                    scores[i] = None if value is None else 1.0 - value
        return scores

    label = name or f"noisy({reward.name}, {flip_prob:g})"
    return KeyedReward(label, flipped, is_group=True)
