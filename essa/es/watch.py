"""What an ESSA run reads of its own signal: validation checks, the exported point, the stop.

The run's validation split (essa.data.task.Task.val, disjoint from the test split) scores the
SFT adapter, the search's start and the distribution mean at every check. From those scores:

* **the exported point** is chosen among the start and the checked means that beat the SFT
  adapter by more than one paired standard error on validation (where none does, the SFT
  adapter itself: a run never moves off its SFT adapter on a lucky draw). ``run.export:
  latest`` takes the last of them unless an earlier one beats it by more than their paired
  SE; ``best`` takes the highest validation score, which on a slow climb read through noisy
  checks is most often an early, lucky one (docs/signal.md).
* **the stop**: ``run.patience`` checks in a row without a new best validation score end the
  search, and so does a check without one whose generations had no signal (the median
  split-half reliability of the last ``run.signal_window`` generations below
  ``run.min_signal``, essa.es.signal).
* **the pre-flight**: a start at the floor of the validation score (below :data:`FLOOR`),
  where a dense tie-breaker does not carry the signal, or at its ceiling (:class:`StartCeiling`:
  nearly every item right) is not searched (``run.on_no_signal: keep_start``); the run says so
  in one line, and the summary keeps the ceiling's count.

numpy only; every rank holds the same scores (all-gathered), so every rank decides the same,
and the state is in the checkpoint, so a resumed run decides the same too. The scores come in
from the run's start (essa.es.baselines.open_watch) and its checks (essa.es.checks).
docs/signal.md.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from essa.config import RunConfig
from essa.types import AdapterVector

FLOOR = 0.03  # a start scoring below this on validation is at the floor ...
CEILING = 0.97  # ... and above this at the ceiling: the reward has little left to rank


def paired_gain(scores: Sequence[float], reference: Sequence[float]) -> tuple[float, float]:
    """(mean gain, its paired standard error) of per-item ``scores`` over ``reference``.

    >>> paired_gain([1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0])
    (0.5, 0.28867513459481287)
    """
    d = np.asarray(scores, dtype=np.float64) - np.asarray(reference, dtype=np.float64)
    if d.size < 2:
        return (float(d.mean()) if d.size else 0.0), 0.0
    return float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size))


def beyond_se(gain: float, se: float) -> bool:
    """Whether a paired gain is positive and larger than its standard error: the one test
    every choice on validation makes (off the SFT adapter, between two points, after the KL
    budget's hold).

    >>> beyond_se(0.03, 0.02), beyond_se(0.01, 0.02), beyond_se(0.0, 0.0)
    (True, False, False)
    """
    return gain > 0 and gain > se


def clearly_better(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether validated point ``a`` beats ``b`` by more than their paired SE on the same
    validation items (a point recorded without its per-item scores never does).

    >>> a, b = {"scores": [1.0] * 9 + [0.0]}, {"scores": [0.0] * 9 + [1.0]}
    >>> clearly_better(a, b), clearly_better(b, a)
    (True, False)
    """
    if not (a.get("scores") and b.get("scores")):
        return False
    return beyond_se(*paired_gain(a["scores"], b["scores"]))


def at_an_edge(scores: Sequence[float]) -> str | None:
    """ "floor" or "ceiling" where per-item validation ``scores`` are there (the pre-flight's
    thresholds), else None.

    >>> at_an_edge([0.0] * 40), at_an_edge([1.0] * 40), at_an_edge([0.0, 1.0])
    ('floor', 'ceiling', None)
    """
    if not len(scores):
        return None
    if StartCeiling.of(scores) is not None:
        return "ceiling"
    return "floor" if float(np.mean(scores)) < FLOOR else None


@dataclass(frozen=True)
class WatchSettings:
    """What the watch reads of the config (section ``run``)."""

    patience: int = 2  # checks without a new best validation score before the run stops; 0: off
    min_signal: float = 0.1  # a check without a new best stops the run below this signal
    signal_window: int = 10  # generations whose median signal a check reads
    on_no_signal: str = "keep_start"  # keep_start | search
    export: str = "latest"  # latest | best: which validated point is exported

    @classmethod
    def of(cls, run: RunConfig) -> WatchSettings:
        return cls(run.patience, run.min_signal, run.signal_window, run.on_no_signal, run.export)


@dataclass(frozen=True)
class StartCeiling:
    """A start that already gets (nearly) every validation item right: its share of items with
    full credit reads :data:`CEILING` or more to two places (31 of 32), or its mean score is
    above it. The reward then ranks candidates on the few items left, and the search can only
    drift (a 1.000 start that searched ended 0.988-1.000 on products, docs/tools.md)."""

    right: int  # validation items the start scores 1 on
    items: int
    score: float  # its mean validation score, partial credit included

    @classmethod
    def of(cls, scores: Sequence[float]) -> StartCeiling | None:
        """The start's ceiling from its per-item scores; None below it (or no items).

        >>> StartCeiling.of([1.0] * 31 + [0.0])
        StartCeiling(right=31, items=32, score=0.96875)
        >>> StartCeiling.of([1.0] * 30 + [0.0] * 2) is None
        True
        """
        if not len(scores):
            return None
        right, score = sum(float(s) >= 1.0 for s in scores), float(np.mean(scores))
        if round(right / len(scores), 2) < CEILING and score <= CEILING:
            return None
        return cls(int(right), len(scores), score)

    def line(self, keep: bool) -> str:
        """The pre-flight's line, with what the run does (``keep``: run.on_no_signal
        keep_start)."""
        head = (
            f"start at the ceiling: {self.right} of {self.items} validation prompts right "
            f"({self.right / self.items:.2f}; mean score {self.score:.3f}); the search can only "
            "drift"
        )
        if keep:
            return (
                f"{head}: keeping the start (run.on_no_signal: keep_start); what would help: a "
                "harder task"
            )
        return f"{head}; searching anyway (run.on_no_signal: search)"


class Watch:
    """The run's validation record and its decisions; ``state`` is the checkpointed dict."""

    def __init__(self, settings: WatchSettings, state: dict[str, Any] | None = None) -> None:
        self.settings = settings
        self.state: dict[str, Any] = state or {
            "reference": None,  # the SFT adapter's per-item validation scores
            # every validated point: name, generation, score, gain, se, vector, per-item scores
            "points": [],
            "chosen": None,  # index in points of the exported point (None: the SFT adapter)
            "best": None,  # the best validation score so far (from the search's start on)
            "since_best": 0,  # checks since the best score last rose
            "signals": [],  # the signal of every generation
            "stop": None,  # why the search stopped early (None: it did not)
        }

    # ------------------------------------------------------------------ validation scores
    def observe(
        self, name: str, generation: int, vector: AdapterVector, scores: Sequence[float]
    ) -> dict[str, Any]:
        """Record a validated point; the fields for its metrics record."""
        s = self.state
        score = float(np.mean(scores)) if len(scores) else float("nan")
        if s["reference"] is None:  # the first point is the SFT adapter, the reference
            s["reference"] = [float(x) for x in scores]
        gain, se = paired_gain(scores, s["reference"])
        point = {
            "name": name,
            "generation": generation,
            "score": score,
            "gain": gain,
            "se": se,
            "vector": np.asarray(vector, dtype=np.float64).tolist(),
            "scores": [float(x) for x in scores],
        }
        s["points"].append(point)
        improved = s["best"] is None or score > s["best"]
        s["best"] = score if improved else s["best"]
        s["since_best"] = 0 if improved else s["since_best"] + 1
        s["chosen"] = self._choose()
        return {"val_accuracy": score, "val_gain": gain, "val_se": se, "val_best": s["best"]}

    @staticmethod
    def _beats_reference(point: dict[str, Any]) -> bool:
        return beyond_se(point["gain"], point["se"])

    def _valid(self) -> list[int]:
        """Indices of the points that beat the SFT adapter by more than their paired SE."""
        return [i for i, p in enumerate(self.state["points"]) if self._beats_reference(p)]

    def _choose(self) -> int | None:
        """The index of the point to export (None: the SFT adapter), by ``run.export``."""
        points = self.state["points"]
        valid = self._valid()
        if not valid:
            return None
        if self.settings.export == "best":  # the first of the highest scores
            return max(valid, key=lambda i: points[i]["score"])
        # The search climbs on its training reward, so its last validated point is the one to
        # keep unless validation shows an earlier one is better beyond its noise: the highest
        # of a few noisy checks of a slow climb is an early, lucky one more often than not.
        latest = valid[-1]
        better = [i for i in valid[:-1] if clearly_better(points[i], points[latest])]
        return max(better, key=lambda i: points[i]["score"]) if better else latest

    def start_search(self, start: float | None = None) -> None:
        """Patience counts the search's own checks from here, against ``start``: the validation
        score of the point the search starts from (None: the best point so far). A scaled start
        the search does not start from (it did not beat the SFT adapter beyond its SE) is no
        bar for the search: its reading is as noisy as the search's own checks."""
        if start is not None:
            self.state["best"] = float(start)
        self.state["since_best"] = 0

    def validated(self, index: int = -1) -> bool:
        """Whether point ``index`` beats the SFT adapter by more than its paired SE."""
        return self._beats_reference(self.state["points"][index])

    # ------------------------------------------------------------------ the stop
    def signal(self, value: float | None) -> None:
        if value is not None:
            self.state["signals"].append(float(value))

    def median_signal(self) -> float | None:
        window = self.state["signals"][-self.settings.signal_window :]
        return statistics.median(window) if window else None

    def stop_after_check(self, generation: int) -> str | None:
        """After a check: why the search stops here (recorded), or None."""
        s, cfg = self.state, self.settings
        if s["since_best"] == 0:
            return None
        # The signal stop reads a full window: a median of one or two generations is noise.
        full = len(s["signals"]) >= cfg.signal_window
        median = self.median_signal() if full else None
        reason = None
        if cfg.patience and s["since_best"] >= cfg.patience:
            reason = (
                f"validation has not improved for {s['since_best']} checks "
                f"(best {s['best']:.3f}, run.patience {cfg.patience})"
            )
        elif cfg.min_signal > 0 and median is not None and median < cfg.min_signal:
            reason = (
                f"no new best validation score and no signal: the median split-half "
                f"reliability of the last {cfg.signal_window} generations is {median:.2f} (run.min_signal {cfg.min_signal:g})"
            )
        if reason is not None:
            s["stop"] = f"stopping after generation {generation + 1}: {reason}"
        return s["stop"]

    # ------------------------------------------------------------------ the pre-flight
    def preflight(self, scores: Sequence[float], dense_informative: bool | None) -> str | None:
        """Before the search: the one line saying why it would search blind, or None.
        ``scores``: the search's start's per-item validation scores; ``dense_informative``:
        whether the tie-breaker's check found it ranks (None: the check did not run)."""
        ceiling = StartCeiling.of(scores)
        keep = self.settings.on_no_signal == "keep_start"
        line: str | None
        if ceiling is not None:
            self.state["start_ceiling"] = dataclasses.asdict(ceiling)
            line = ceiling.line(keep)
        else:
            line = self._floor_line(float(np.mean(scores)), dense_informative, keep)
        if keep and line is not None:
            self.state["stop"] = line
            self.state["kept_at_preflight"] = True
        return line

    def _floor_line(self, start: float, dense_informative: bool | None, keep: bool) -> str | None:
        """The floor's line: a start scoring below FLOOR with no tie-breaker to rank by (or
        none checked: from the floor the scaled start and its check are not tried)."""
        if start >= FLOOR or dense_informative:
            return None
        n = len(self.state["reference"] or ())
        action = "keeping the start (run.on_no_signal: keep_start)" if keep else "searching anyway"
        tie = "no tie-breaker carries the ranking" if dense_informative is False else (
            "the scaled start and the tie-breaker's check are not tried from the floor"
        )  # fmt: skip
        return (
            f"no signal: the start scores {start:.3f} on {n} validation items, at the floor "
            f"(< {FLOOR:g}), and {tie}; {action}; what would help: a longer SFT (sft.steps), "
            "an easier curriculum (data.params) or sampled completions "
            "(generation.temperature, generation.samples_per_prompt)"
        )

    @property
    def validating(self) -> bool:
        """Whether the run has validation items to check against."""
        return bool(self.state["reference"])

    def summary(self) -> dict[str, Any]:
        """The summary's account of the run's signal: why it stopped early (None: it did not),
        the median signal over its generations and the validation items."""
        signals = self.state["signals"]
        return {
            "stop_reason": self.state["stop"],
            "signal_median": statistics.median(signals) if signals else None,
            "val_size": len(self.state["reference"] or ()),
            "start_ceiling": self.state.get("start_ceiling"),
        }

    def unchecked(self, generations: int) -> bool:
        """Whether the search's mean after ``generations`` still needs its validation check:
        the search ran past its last check (a ceiling or budget between checks)."""
        s = self.state
        if not self.validating or generations == 0 or s["stop"] is not None:
            return False
        return s["points"][-1]["generation"] != generations - 1

    @property
    def stopped(self) -> bool:
        return self.state["stop"] is not None

    # ------------------------------------------------------------------ the export
    def _why(self, p: dict[str, Any]) -> str:
        """Why point ``p`` (the chosen one) is exported, in the summary's words."""
        against = f"+{p['gain']:.3f}, SE {p['se']:.3f} over the SFT adapter"
        if self.settings.export == "best":
            return (
                f"the best validation score ({p['score']:.3f}) among the points that beat the "
                f"SFT adapter by more than their paired SE ({against})"
            )
        latest = self.state["points"][self._valid()[-1]]
        if latest is p:
            return (
                f"the latest point that beats the SFT adapter by more than its paired SE "
                f"({against}; validation {p['score']:.3f}), no earlier one better beyond their "
                "paired SE"
            )
        gain, se = paired_gain(p["scores"], latest["scores"])
        return (
            f"it beats the latest validated point ({latest['name']}) by +{gain:.3f} (paired SE "
            f"{se:.3f}) on validation ({against})"
        )

    def choice(self, fallback: AdapterVector) -> tuple[AdapterVector, dict[str, Any]]:
        """The exported vector and the summary's account of it. Without validation items
        (data.val_size 0) the run exports ``fallback`` (the search's mean) unchecked."""
        s = self.state
        if not s["points"] or not s["reference"]:
            return np.asarray(fallback), {"point": "search mean", "why": "no validation split"}
        checked = [{k: v for k, v in p.items() if k not in ("vector", "scores")}
                   for p in s["points"]]  # fmt: skip
        if s["chosen"] is None:
            sft = s["points"][0]
            why = (
                f"no point beat the SFT adapter by more than its paired SE on "
                f"{len(s['reference'])} validation items"
            )
            if s.get("kept_at_preflight"):
                why = "the pre-flight kept the start: " + s["stop"].split(":")[0]
            return np.zeros(len(sft["vector"])), {
                "point": sft["name"], "generation": sft["generation"],
                "val_accuracy": sft["score"], "why": why, "checked": checked,
            }  # fmt: skip
        p = s["points"][s["chosen"]]
        why = self._why(p)
        return np.asarray(p["vector"]), {
            "point": p["name"], "generation": p["generation"], "val_accuracy": p["score"],
            "val_gain": p["gain"], "val_se": p["se"], "why": why, "checked": checked,
        }  # fmt: skip
