"""Math answer verification: extraction, a fast path without sympy, math-verify, thread-safe.

Grading one item (spec rewards-and-eval.md §2-3):

1. gold = :func:`~essa.rewards.extract.normalize_gold` (GSM8K ``####`` tail, boxed content,
   thousands separators); pred = the answer of the completion's
   :func:`~essa.rewards.extract.final_statement`. A statement that names several candidate
   values ("2 or 3", "between 10 and 20", ``\boxed{2} or \boxed{3}``) is wrong, status
   ``"hedged"``, when the gold is one value (:mod:`essa.rewards.hedge`). Both are then read
   whole where they are one number (:func:`~essa.rewards.numeric.canonical_number`: ``3 1/2``,
   ``5 million``, ``1e3``).
2. Fast path, no sympy (:func:`~essa.rewards.grading.fast_grade`): strings equal up to spaces
   are correct; if both are plain numbers (integers, decimals, ``a/b``, ``\\frac{a}{b}``) they
   are compared exactly as fractions. Equal -> correct. Unequal -> wrong, unless a decimal has
   6 or more fractional digits, where math-verify's rounding to 6 places could still call them
   equal; those go to step 3. This decides almost every GSM8K and arithmetic item in
   microseconds.
3. math-verify: ``verify(parse(gold), parse(pred))``, gold first (verify is not symmetric),
   both wrapped as ``\\boxed{...}`` so that LaTeX and plain text parse alike. Verdicts are
   cached per (gold, pred) string pair: a population shares its prompts and often its answers.

Timeouts (spec §3.4): math-verify bounds parse and verify with ``signal.alarm``, which works only
on the main thread. On the main thread we call it in-process with its timeouts on. Anywhere else
(a worker thread, a thread pool) the slow items go to worker processes
(:class:`~essa.rewards.verify_worker.VerifyWorkers`), where each call again runs on a main
thread with the timeouts on, plus a per-item wall-clock deadline that kills a stuck worker.
Math-verify is never run with its timeouts removed. A timeout grades as wrong (0.0) with status
``"timeout"``: a policy must not gain from slow-to-verify output.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

from essa.rewards.base import RewardStats, ScoreFn
from essa.rewards.extract import final_statement, normalize_answer, normalize_gold
from essa.rewards.grading import Grade, fast_grade, grade_strings
from essa.rewards.hedge import is_hedged, names_one_value
from essa.rewards.numeric import canonical_number
from essa.rewards.verify_worker import VerifyWorkers

# Per item at most two parses and a few candidate comparisons, each bounded by the timeout.
_CALLS_PER_ITEM = 6


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class MathVerifier:
    """Grades (completion, gold) pairs; holds a verdict cache and, when needed, worker processes.

    Args:
        timeout_seconds: bound for each math-verify parse and comparison (integer seconds,
            ``signal.alarm`` resolution).
        use_process_pool: verify in worker processes even on the main thread (parallel
            speed-up for large batches of non-numeric answers). Off the main thread they are
            always used.
        num_workers: worker processes; default ``min(4, os.cpu_count())``.
        use_last_number: fall back to the last number of the completion when it has no box,
            ``####`` or answer phrase.
        use_fast_path: decide equal strings and plain-number pairs without sympy.
        cache_size: verdicts kept per (gold, pred) string pair; the cache is emptied when full.
    """

    def __init__(
        self,
        *,
        timeout_seconds: int = 5,
        use_process_pool: bool = False,
        num_workers: int | None = None,
        use_last_number: bool = True,
        use_fast_path: bool = True,
        cache_size: int = 100_000,
    ) -> None:
        if int(timeout_seconds) != timeout_seconds or timeout_seconds < 1:
            raise ValueError(f"timeout_seconds must be a whole number >= 1, got {timeout_seconds}")
        self.timeout_seconds = int(timeout_seconds)
        self.use_process_pool = use_process_pool
        self.num_workers = num_workers or min(4, os.cpu_count() or 1)
        self.use_last_number = use_last_number
        self.use_fast_path = use_fast_path
        self.cache_size = cache_size
        self._cache: dict[tuple[str, str | None], Grade] = {}
        self._lock = threading.Lock()
        self._workers: VerifyWorkers | None = None

    def grade(self, completions: Sequence[str], answers: Sequence[str | None]) -> list[Grade]:
        """One :class:`~essa.rewards.grading.Grade` per (completion, gold answer) pair."""
        grades: list[Grade | None] = [None] * len(completions)
        golds: list[str] = []
        preds: list[str | None] = []
        where: list[int] = []
        for i, (completion, answer) in enumerate(zip(completions, answers, strict=True)):
            if answer is None:
                grades[i] = Grade(None, "no_gold")
                continue
            gold = normalize_gold(str(answer))
            if not gold:
                grades[i] = Grade(None, "bad_gold")
                continue
            statement = final_statement(completion, use_last_number=self.use_last_number)
            if statement is not None and is_hedged(statement) and names_one_value(gold):
                grades[i] = Grade(False, "hedged")
                continue
            golds.append(gold)
            preds.append(None if statement is None else normalize_answer(statement.answer))
            where.append(i)
        for i, grade in zip(where, self.compare(golds, preds), strict=True):
            grades[i] = grade
        return [grade for grade in grades if grade is not None]

    def compare(self, golds: Sequence[str], preds: Sequence[str | None]) -> list[Grade]:
        """Grade already-extracted answers ``preds`` against normalised, non-empty ``golds``
        (no extraction): ``verify(gold, pred)``, gold first. Also the equivalence test of the
        answer clustering in :mod:`essa.rewards.label_free`."""
        grades: list[Grade | None] = [None] * len(golds)
        pending: dict[tuple[str, str | None], list[int]] = {}
        for i, (gold, pred) in enumerate(zip(golds, preds, strict=True)):
            # "5 million", "3 1/2", "1e3" as plain numbers, which both graders read.
            gold = canonical_number(gold)
            pred = None if pred is None else canonical_number(pred)
            grade = fast_grade(gold, pred) if self.use_fast_path else None
            if grade is None:
                grade = self._cache.get((gold, pred))
            if grade is None:
                pending.setdefault((gold, pred), []).append(i)
            else:
                grades[i] = grade
        keys = list(pending)
        for key, grade in zip(keys, self._grade_slow(keys), strict=True):
            if grade.status in ("ok", "no_answer", "bad_gold"):
                self._remember(key, grade)
            for i in pending[key]:
                grades[i] = grade
        return [grade for grade in grades if grade is not None]

    def _remember(self, key: tuple[str, str | None], grade: Grade) -> None:
        with self._lock:
            if len(self._cache) >= self.cache_size:
                self._cache.clear()
            self._cache[key] = grade

    def _grade_slow(self, keys: list[tuple[str, str | None]]) -> list[Grade]:
        if not keys:
            return []
        if _on_main_thread() and not self.use_process_pool:
            return [Grade(*grade_strings(gold, pred, self.timeout_seconds)) for gold, pred in keys]
        with self._lock:
            if self._workers is None:
                self._workers = VerifyWorkers(self.num_workers)
            workers = self._workers
        item_seconds = _CALLS_PER_ITEM * self.timeout_seconds + 1.0
        return [Grade(*result) for result in workers.run(keys, self.timeout_seconds, item_seconds)]

    def close(self) -> None:
        """Stop the worker processes, if any (a later slow item starts new ones)."""
        with self._lock:
            if self._workers is not None:
                self._workers.close()
            self._workers = None


def math_accuracy(
    stats: RewardStats,
    *,
    timeout_seconds: int = 5,
    use_process_pool: bool = False,
    num_workers: int | None = None,
    use_last_number: bool = True,
    use_fast_path: bool = True,
) -> ScoreFn:
    """Binary accuracy: 1.0 if the extracted answer is equivalent to the gold, else 0.0.

    ``R = 1[verify(parse(gold), parse(extract(completion)))]`` (spec §4 "Binary accuracy").
    None when the gold is None or does not parse; 0.0 when no answer can be extracted or
    verification timed out (counted in ``stats.n_timeout``); None, counted in
    ``stats.n_error``, if a verification worker process died. See :class:`MathVerifier`
    for the parameters.

    >>> from essa.rewards import get_reward
    >>> get_reward("math_accuracy")([r"so \\boxed{\\frac{1}{2}}", "#### 7"], ["0.5", "8"], ["", ""])
    [1.0, 0.0]
    """
    verifier = MathVerifier(
        timeout_seconds=timeout_seconds,
        use_process_pool=use_process_pool,
        num_workers=num_workers,
        use_last_number=use_last_number,
        use_fast_path=use_fast_path,
    )

    def score(
        completions: list[str], answers: list[str | None], prompts: list[str]
    ) -> list[float | None]:
        grades = verifier.grade(completions, answers)
        count_grades(stats, grades)
        return [None if grade.correct is None else float(grade.correct) for grade in grades]

    return score


def count_grades(stats: RewardStats, grades: Sequence[Grade]) -> None:
    """Add the timeouts and worker errors among ``grades`` to ``stats``."""
    stats.add(
        n_timeout=sum(grade.status == "timeout" for grade in grades),
        n_error=sum(grade.status == "error" for grade in grades),
    )
