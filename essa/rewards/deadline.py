"""A wall-clock bound on each call of a reward that does not bound itself (custom rewards).

``with_deadline(reward, seconds)`` runs every call of the wrapped batch function in a daemon
thread and waits at most ``seconds``. A call that does not return in time scores every item of
that call ``None`` (not gradable), counted in ``stats.n_timeout`` and ``stats.n_none``: for an
ESSA candidate that is NaN fitness, ranked last, and a generation in which every candidate
failed stops the run with a clear error.

Why ``None`` and not ``0.0`` (math-verify's timeout grade, :mod:`essa.rewards.accuracy`): a
custom reward may have any range, so 0.0 could rank a hung call *above* honest negative scores;
NaN always ranks last. Limits: a Python thread cannot be killed, so a timed-out call is
abandoned, not stopped (a call that spins forever keeps one core busy until the process ends),
and the next call may run while it is still going. The built-in rewards are not wrapped:
math-verify already bounds each item (and a worker thread would move it off the main thread,
into slower worker processes).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from essa.rewards.base import Reward

logger = logging.getLogger(__name__)


def with_deadline(reward: Reward, seconds: float) -> Reward:
    """``reward`` with each call bounded by ``seconds`` of wall-clock time (same stats object).

    >>> import time
    >>> from essa.rewards import Reward
    >>> slow = Reward("slow", lambda c, a, p: time.sleep(5) or [1.0] * len(c))
    >>> bounded = with_deadline(slow, 0.1)
    >>> bounded(["x"], ["1"], ["p"]), bounded.stats.n_timeout
    ([None], 1)
    """
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    inner = reward.fn
    stats = reward.stats
    warned: list[bool] = []  # warn on the first timeout; stats.n_timeout counts them all

    def bounded(
        completions: list[str], answers: list[str | None], prompts: list[str]
    ) -> list[float | None]:
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["value"] = inner(completions, answers, prompts)
            except BaseException as error:  # re-raised in the caller's thread below
                box["error"] = error

        worker = threading.Thread(target=call, name=f"reward-{reward.name}", daemon=True)
        worker.start()
        worker.join(seconds)
        if worker.is_alive():
            stats.add(n_timeout=len(completions))
            logger.log(
                logging.DEBUG if warned else logging.WARNING,
                "reward %r did not return within %g s on %d items; they score None "
                "(further timeouts are counted, not logged)",
                reward.name,
                seconds,
                len(completions),
            )
            warned.append(True)
            return [None] * len(completions)
        if "error" in box:
            raise box["error"]
        return box["value"]  # type: ignore[no-any-return]

    return Reward(reward.name, bounded, stats, is_group=reward.is_group)
