"""bench.studies.drift_budget's tables from run records (the runs themselves are the bench's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.studies.drift_budget import summarise, table


def record(arm: str, seed: int, gain: float, kl: float) -> dict:
    return {
        "arm": arm, "seed": seed, "sft": 0.5, "final": 0.5 + gain,
        "vs_sft": {"gain": gain, "se": 0.01, "n": 100}, "kl_base": kl, "kl_sft": kl / 2,
        "kl_base_sft": 0.02, "update_search": 0.01, "retention": None, "generations": 10,
    }  # fmt: skip


def test_arms_pool_their_seeds_and_keep_their_order() -> None:
    runs = [record("off", 0, 0.10, 0.08), record("anchor 1", 0, 0.04, 0.03),
            record("off", 1, 0.06, 0.06), record("anchor 1", 1, 0.02, 0.01)]  # fmt: skip
    summary = summarise(runs)
    assert list(summary) == ["off", "anchor 1"]
    assert summary["off"]["gain"]["gain"] == pytest.approx(0.08)
    assert summary["off"]["gain"]["se"] == pytest.approx(0.01 * 2**0.5 / 2)
    assert summary["anchor 1"]["kl_base"] == pytest.approx(0.02)
    assert summary["off"]["retention"] is None
    lines = table(summary).splitlines()
    assert lines[2].startswith("| off | 2 | 0.500 | 0.580 | +0.080 (0.007) | 0.0700 | 0.0350 |")
    assert lines[3].endswith("| - |")  # no retention measured


def test_passes_table_keeps_the_checks_every_arm_reached(tmp_path: Path) -> None:
    from bench.studies.drift_budget import pass_records, passes_table

    def check(generation: int, gain: float) -> dict:
        return {"generation": generation, "val_accuracy": 0.5 + gain, "val_gain": gain,
                "val_se": 0.02, "drift_kl_base": 0.1, "drift_kl_sft": 0.05, "drift_update": 0.01}  # fmt: skip

    for name, checks in (("off", [9, 19, 29]), ("decay_01", [9, 19])):
        run = tmp_path / f"{name}-seed0"
        run.mkdir()
        lines = [{"generation": -1, "heldout_accuracy": 0.5}, {"generation": 0, "sigma": 1.0}]
        lines += [check(g, g / 100) for g in checks]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    arms = {
        a: pass_records(tmp_path / f"{n}-seed0")
        for a, n in (("off", "off"), ("decay 0.1", "decay_01"))
    }
    rows = passes_table(arms).splitlines()[2:]
    assert [r.split(" | ")[:2] for r in rows] == [
        ["| 10", "off"], ["| 10", "decay 0.1"], ["| 20", "off"], ["| 20", "decay 0.1"]
    ]  # fmt: skip
    assert rows[2] == "| 20 | off | 0.690 | +0.190 (0.020) | 0.1000 | 0.0500 | 0.0100 |"
