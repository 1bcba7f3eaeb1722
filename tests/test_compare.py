"""`essa compare` on two hand-written run directories (one ESSA, one GRPO)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from essa.cli import app


def fake_run(root: Path, name: str, summary: dict, steps: list[dict]) -> Path:
    run_dir = root / name
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps(summary))
    lines = [{"generation": -1, "event": "baseline", "heldout_accuracy": 0.5}, *steps]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run_dir


def test_compare_writes_table_and_plot(tmp_path: Path) -> None:
    essa = fake_run(
        tmp_path,
        "essa",
        {"baseline_accuracy": 0.5, "final_accuracy": 0.8, "wall_seconds": 9.0, "peak_rss_mb": 600},
        [
            {"generation": 0, "seconds": 1.0, "new_tokens": 100, "mean_fitness": 0.6},
            {"generation": 1, "seconds": 1.0, "new_tokens": 100, "mean_fitness": 0.7,
             "heldout_accuracy": 0.8},
        ],
    )  # fmt: skip
    grpo = fake_run(
        tmp_path,
        "grpo",
        {"algorithm": "grpo", "loss": "dapo", "trainable": "lora", "baseline_accuracy": 0.5,
         "final_accuracy": 0.95, "wall_seconds": 5.0},
        [
            {"generation": 0, "seconds": 2.0, "new_tokens": 10, "mean_reward": 0.5,
             "heldout_accuracy": 0.92},
            {"generation": 1, "seconds": 2.0, "new_tokens": 10, "mean_reward": 0.6},
        ],
    )  # fmt: skip
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["compare", str(essa), str(grpo), "--output", str(out)])
    assert res.exit_code == 0, res.output
    rows = (out / "compare.md").read_text().splitlines()
    # ESSA never reaches 0.9; GRPO does at its first evaluation (2 s, 10 tokens).
    assert rows[2].startswith("| essa | essa | 0.500 | 0.800 | 0.800 | n/a | n/a | 2.0 | 200 |")
    assert rows[3].startswith("| grpo | grpo (dapo, lora) | 0.500 | 0.950 | 0.950 | 2.0 | 10 |")
    assert (out / "compare.png").stat().st_size > 1000


def test_compare_rejects_unfinished_run(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["compare", str(tmp_path)])
    assert res.exit_code == 2 and "not a finished run" in res.output
