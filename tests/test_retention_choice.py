"""Which task retention measures (evaluation.drift.retention, docs/drift.md): the demo's auto
choice, a real model's list of tasks its base model can do, and never the training task."""

from __future__ import annotations

from pathlib import Path

import pytest

from essa.config import ConfigError, load_config
from essa.drift.retention import retention_source

REPO = Path(__file__).resolve().parents[1]
REAL_MODEL_CONFIGS = ("configs/smollm2.yaml",)

pytest.importorskip("reasoning_gym")


def source(path: str | None, *overrides: str) -> str | None:
    cfg = load_config(None if path is None else REPO / path, list(overrides))
    return retention_source(cfg.evaluation.drift, cfg.data)


def training_task(path: str, task: str) -> list[str]:
    """Overrides that make reasoning-gym ``task`` (at its default parameters) the training task."""
    return [f"data.source={task}", "data.params={}", f"reward.params.task={task.split(':')[1]}",
            "reward.params.params={}"]  # fmt: skip


def test_the_demo_keeps_its_auto_choice() -> None:
    assert load_config(None).evaluation.drift.retention == "auto"
    assert source(None) == "builtin:arithmetic_mixed"
    assert source(None, "data.source=builtin:arithmetic_mixed") == "builtin:arithmetic"


@pytest.mark.parametrize("path", REAL_MODEL_CONFIGS)
def test_a_real_models_config_measures_the_first_task_it_does_not_train_on(path: str) -> None:
    tasks = load_config(REPO / path).evaluation.drift.retention
    assert isinstance(tasks, tuple) and len(tasks) >= 2
    assert source(path) == tasks[0]
    # Trained on the first task, the run falls back to the second, never its own task.
    assert source(path, *training_task(path, tasks[0])) == tasks[1]
    assert source(path, *training_task(path, tasks[1])) == tasks[0]


def test_a_list_is_checked_task_by_task_and_cannot_name_only_the_training_task() -> None:
    listed = "evaluation.drift.retention=[builtin:arithmetic, builtin:arithmetic3]"
    assert source(None, listed) == "builtin:arithmetic3"  # the demo trains on builtin:arithmetic
    assert source(None, listed, "evaluation.drift.items=0") is None
    with pytest.raises(ConfigError, match="builtin:arithmetic is the training task"):
        load_config(None, ["evaluation.drift.retention=[builtin:arithmetic]"])
    with pytest.raises(ConfigError, match="'gsm8k' is not auto"):
        load_config(None, ["evaluation.drift.retention=[builtin:arithmetic3, gsm8k]"])
    with pytest.raises(ConfigError, match="no such reasoning-gym task"):
        load_config(None, ["evaluation.drift.retention=[reasoning_gym:no_such_task]"])
    with pytest.raises(ConfigError, match="an empty list"):
        load_config(None, ["evaluation.drift.retention=[]"])
