"""bench/studies/signal.py's bookkeeping on hand-made runs, and bench/studies/tiny_prm.py's PRM end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.studies.common import curve, rows_to
from bench.studies.signal import summarise, table


def write_run(run_dir: Path, records: list[dict], *sets: str) -> Path:
    """A run directory with a resolved config.yaml and the given metrics records."""
    from essa.config import dump_config, load_config

    run_dir.mkdir(parents=True)
    cfg = load_config(None, ["data.batch_size=8", "optimizer.population_size=4", *sets])
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def test_curve_counts_training_rows_of_each_recipe(tmp_path: Path) -> None:
    records = [
        {"generation": -1, "heldout_accuracy": 0.5},
        {"generation": 0},
        {"generation": 1, "heldout_accuracy": 0.6},
        {"generation": 2, "heldout_accuracy": 0.7},
    ]
    essa = write_run(tmp_path / "essa", records)
    assert curve(essa) == [(0, 0.5), (64, 0.6), (96, 0.7)]  # 4 candidates x 1 sample x 8
    grpo_records = [{**r, "sampling_rounds": 2} if r["generation"] == 1 else r for r in records]
    grpo = write_run(tmp_path / "grpo", grpo_records, "algorithm=grpo", "grpo.group_size=4",
                     "grpo.prompts_per_step=2")  # fmt: skip
    assert curve(grpo) == [(0, 0.5), (8 + 16, 0.6), (8 + 16 + 8, 0.7)]


def test_rows_to_threshold_and_the_ratio() -> None:
    points = [(0, 0.5), (100, 0.6), (200, 0.8), (300, 0.75)]
    assert rows_to(points, 0.8) == 200
    assert rows_to(points, 0.6) == 100
    assert rows_to(points, 0.9) is None
    off = {"sft": 0.5, "final": 0.7, "curve": [(0, 0.5), (100, 0.6), (200, 0.7)],
           "scores": [1.0, 0.0, 1.0, 0.0], "wall_seconds": 60, "rows": 200,
           "prompts_skipped": 0, "prompts_hinted": 0}  # fmt: skip
    on = {**off, "final": 0.75, "curve": [(0, 0.5), (100, 0.7), (200, 0.75)],
          "scores": [1.0, 1.0, 1.0, 0.0], "prompts_skipped": 12}  # fmt: skip
    s = summarise([on], [off])
    # threshold 0.5 + 0.9 * 0.2 = 0.68: off reaches it at 200 rows, on at 100
    assert s["rows_ratio_per_seed"] == [2.0] and s["rows_ratio_geomean"] == pytest.approx(2.0)
    assert s["vs_off"] == pytest.approx(0.25)
    assert s["gain_per_minute"] == pytest.approx(0.25)
    never = summarise([{**on, "curve": [(0, 0.5), (200, 0.6)]}], [off])
    assert never["rows_ratio_per_seed"] == [None] and never["rows_ratio_geomean"] is None
    text = table({"summary": {"essa": {"off": summarise([off], [off]), "greso": s}}})
    assert "| essa | `greso` | 0.500 | 0.750 | +0.250" in text and "2.00x (2.00)" in text


@pytest.mark.slow
def test_tiny_prm_trains_and_scores_through_the_prm_reward(tmp_path: Path) -> None:
    from bench.studies.tiny_prm import train_demo_prm
    from essa.rewards import get_reward

    stats = train_demo_prm(tmp_path / "prm", steps=20)
    assert stats["held_back_items"] == 1000
    assert 0.0 <= stats["held_back_accuracy"] <= 1.0
    assert (
        abs(stats["held_back_accuracy"] * 1000 - round(stats["held_back_accuracy"] * 1000)) < 1e-6
    )
    reward = get_reward("prm", prm=str(tmp_path / "prm"), outcome=None, aggregate="min")
    scores = reward(["110", "111"], [None, None], ["47+63=", "47+63="])
    assert all(0.0 < s < 1.0 for s in scores)  # one step each: the label-1 probability
