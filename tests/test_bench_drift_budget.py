"""bench.studies.drift_budget's tables from run records (the runs themselves are the bench's)."""

from __future__ import annotations

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
