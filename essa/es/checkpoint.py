"""ESSA's checkpoint: checkpoint.json holds the optimizer's plain-data state (numpy arrays as
lists) and the recipe's own state (best vector, elapsed seconds, the plan, ...), written
atomically by the harness."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from essa.harness import read_json_checkpoint, write_json_checkpoint
from essa.protocols import Optimizer


def save(run_dir: Path, opt: Optimizer, state: dict[str, Any]) -> None:
    """checkpoint.json: the optimizer's plain-data state and the recipe's (best, elapsed, ...)."""
    write_json_checkpoint(run_dir, {"optimizer": opt.state_dict(), **state}, opt.generation)


def load(
    run_dir: Path, build: Callable[[dict[str, Any]], Optimizer]
) -> tuple[Optimizer | None, dict[str, Any] | None]:
    """The optimizer restored from checkpoint.json (``build`` makes it from the saved state,
    so that it starts where the saved search started) and the recipe's state; (None, None)
    when there is no checkpoint."""
    restored: list[Optimizer] = []

    def restore(data: dict[str, Any]) -> None:
        opt = build(data)
        opt.load_state_dict(data.pop("optimizer"))
        restored.append(opt)

    data = read_json_checkpoint(run_dir, restore)
    return (restored[0] if restored else None), data
