"""The run itself: section ``run`` (directory, length, seed, wall-clock budget, trackers), with
its range checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from essa.config.errors import ConfigError

# run.seed feeds numpy's legacy and vLLM's seeds, which take 32 bits; torch takes 64.
MAX_SEED = 2**32 - 1


@dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/essa-demo"
    generations: int = 150
    seed: int = 0  # 0 .. 2**32 - 1 (numpy's and vLLM's seeds are 32-bit)
    max_wall_seconds: float | None = None  # stop before a generation would end past this budget
    # ESSA (HF backend) with max_wall_seconds: size SFT, held-out checks, the scaled start and
    # prompts per generation so that the search gets most of the budget (essa.es.plan)
    plan: bool = True
    # run.generations is a ceiling: the search stops earlier when it has stopped learning
    # (docs/signal.md). Validation checks (every evaluation.every generations) in a row without
    # a new best score before it stops; 0: never.
    patience: int = 2
    # A check without a new best stops the run at once when the median split-half reliability
    # of the reward's ranking over the last signal_window generations is below this; 0: never.
    min_signal: float = 0.1
    signal_window: int = 10
    # A start at the floor or ceiling of the validation score (and no tie-breaker that ranks
    # there): keep_start exports the start without searching; search searches anyway.
    on_no_signal: Literal["keep_start", "search"] = "keep_start"
    # The exported point, among the validated points that beat the SFT adapter by more than
    # their paired SE: latest (the last such point, unless an earlier one beats it by more than
    # their paired SE on validation) or best (the highest validation score of them).
    export: Literal["latest", "best"] = "latest"
    show_progress: bool = True
    # Experiment trackers, any subset (none by default; [track] extra), all offline-safe.
    report_to: tuple[Literal["tensorboard", "wandb", "trackio"], ...] = ()


def check_run(r: RunConfig) -> None:
    if r.generations < 0:
        raise ConfigError(f"run.generations: must be >= 0, got {r.generations}")
    if not 0 <= r.seed <= MAX_SEED:
        raise ConfigError(f"run.seed: must be an integer in [0, {MAX_SEED}], got {r.seed}")
    if r.max_wall_seconds is not None and r.max_wall_seconds <= 0:
        raise ConfigError(f"run.max_wall_seconds: must be > 0 (or null), got {r.max_wall_seconds}")
    if r.patience < 0:
        raise ConfigError(f"run.patience: must be >= 0, got {r.patience}")
    if not 0 <= r.min_signal <= 1:
        raise ConfigError(f"run.min_signal: must be in [0, 1], got {r.min_signal}")
    if r.signal_window < 1:
        raise ConfigError(f"run.signal_window: must be >= 1, got {r.signal_window}")
    if len(set(r.report_to)) != len(r.report_to):
        raise ConfigError(f"run.report_to: a tracker is named twice: {list(r.report_to)}")
