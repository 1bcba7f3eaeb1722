"""Reasoning-pattern reward (RPR, spec §8): "The Climb Carves Wisdom Deeper Than the Summit"
(arXiv 2505.22653), as in trestad/Noisy-Rewards-in-Learning-to-Reason ``think_reward``.
"""

from __future__ import annotations

from collections import Counter

from essa.rewards.base import RewardStats, ScoreFn
from essa.rewards.extract import extract_answer

# Counted by substring test on the lowercased text, each at most once; trailing spaces are part
# of the phrases and "makes sence" is misspelt as in the source.
RPR_PHRASES = (
    "i need to",
    "we need to",
    "wait",
    "alternatively",
    "let me check",
    "let me see",
    "let's focus on",
    "we know that",
    "we can observe ",
    "we can see ",
    "let me try",
    "let's try",
    "let us try",
    "first, ",
    "firstly, ",
    "next, ",
    "finally, ",
    "let us first",
    "let's first",
    "let me first",
    "try again",
    "still not",
    "not working",
    "not correct",
    "does not work",
    "doesn't work",
    "makes sence",
    "since we ",
    "because we ",
    "consequently",
    "as a result",
    "thus",
    "therefore",
    "hence",
    "so that",
    "thereby",
    "if we",
    "given there ",
    "for instance ",
    "for example ",
)
PHRASES_FOR_FULL_SCORE = 20
REPETITION_NGRAM = 20


def ngram_repetition_ratio(text: str, n: int = REPETITION_NGRAM) -> float:
    """Distinct word n-grams that occur more than once, over all word n-grams (0 if none).

    As in the source: a single n-gram repeated many times counts once, so pure degenerate
    repetition ("x x x ...") is penalised by about 1/#n-grams only.

    >>> ngram_repetition_ratio("a b a b a", 2)  # (a b) x2, (b a) x2 -> 2 repeated / 4
    0.5
    """
    words = text.split()
    ngrams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if not ngrams:
        return 0.0
    return sum(count > 1 for count in Counter(ngrams).values()) / len(ngrams)


def reasoning_pattern_score(completion: str) -> float:
    """RPR score of one completion (spec §8):

    1. text = the completion after its first ``<think>`` (all of it if there is none; with the
       ``r1`` template the prompt already ends in ``<think>``), lowercased;
    2. ``score = min(1, #{phrases in RPR_PHRASES occurring in text} / 20)``;
    3. ``score -= ngram_repetition_ratio(text, 20)``;
    4. ``score -= text.count("user: ")`` (the model inventing a new user turn);
    5. ``max(0, score)``.

    >>> reasoning_pattern_score("<think>Wait, we need to add. Thus 4; therefore 4.")
    0.2
    """
    start = completion.find("<think>")
    text = (completion[start + len("<think>") :] if start >= 0 else completion).lower()
    count = sum(phrase in text for phrase in RPR_PHRASES)
    score = min(1.0, count / PHRASES_FOR_FULL_SCORE)
    score -= ngram_repetition_ratio(text, REPETITION_NGRAM)
    score -= text.count("user: ")
    return max(0.0, score)


def reasoning_pattern(stats: RewardStats, *, require_answer: bool = True) -> ScoreFn:
    """RPR phrase reward with its repetition penalty, ``R = reasoning_pattern_score(y)``
    (see there for the formula), in [0, 1]; never None, labels ignored.

    With ``require_answer`` (the source's rule) a completion from which no final answer can be
    extracted (box, ``####`` or an answer phrase; no last-number fallback) scores 0.0: the
    pattern is not rewarded without an answer. The paper uses this score *as* the reward when
    correctness checking is off; add it to ``math_accuracy`` with ``combine`` otherwise.

    >>> from essa.rewards import get_reward
    >>> rpr = get_reward("reasoning_pattern")
    >>> rpr(["Wait, we need to add. Thus \\\\boxed{4}", "Wait, thus 4"], [None] * 2, [""] * 2)
    [0.15, 0.0]
    """

    def score(
        completions: list[str], answers: list[str | None], prompts: list[str]
    ) -> list[float | None]:
        scores: list[float | None] = []
        for text in completions:
            if require_answer and extract_answer(text, use_last_number=False) is None:
                scores.append(0.0)
            else:
                scores.append(reasoning_pattern_score(text))
        return scores

    return score
